"""``rlhf``: run the pipeline, print the config, serve the deployment.

    rlhf run [--config FILE.yaml] [--set key=value ...] [--refresh STAGE ...]
    rlhf config [--config FILE.yaml] [--set ...]     # the resolved config as YAML
    rlhf serve [--cron "0 3 * * 0"] [--config ...]   # deployment rlhf/full, served from this process
    rlhf verify [--config ...]                       # re-hash every artifact in the store against its manifest
    rlhf gc [--yes] [--grace-s 3600] [--config ...]  # unreferenced data folders, checkpoints of finished runs (dry run)
    rlhf ls [--set store.uri=...]                     # the store's artifacts: stage, key, inputs, created, metrics
    rlhf export --stage ppo [--run latest|KEY] --out DIR [--adapter-only]   # a Hugging Face model folder
    rlhf generate --stage ppo [--run latest|KEY] "prompt" ...              # sample from a stage's policy
    rlhf server [stop]                               # the local Prefect server runs leave up (flows/server.py)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import yaml


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlhf", description="data prep -> PEFT LoRA SFT -> reward model -> PPO on Ray, as the Prefect flow `rlhf`.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, helptext in (("run", "run the pipeline now (local Prefect server and local Ray unless configured)"),
                           ("config", "print the resolved config as YAML"),
                           ("serve", "serve deployment rlhf/full (optionally on a cron schedule) from this process"),
                           ("verify", "re-hash every artifact in the store against its manifest (a cached run checks sizes only)"),
                           ("gc", "list (or with --yes delete) unreferenced data folders and checkpoints of finished runs")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--config", help="YAML file with any of the sections seed, store, ray, model, data, sft, rm, ppo, resources")
        s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one value, e.g. --set sft.lr=1e-4 (repeatable)")
        s.add_argument("--refresh", action="append", default=[], metavar="STAGE", help="rebuild this stage even if cached (data, sft, rm, ppo, all)")
        if name == "serve":
            s.add_argument("--cron", help="cron schedule for retraining, e.g. '0 3 * * 0'")
        if name == "gc":
            s.add_argument("--yes", action="store_true", help="delete (default: a dry run that prints what would go)")
            s.add_argument("--grace-s", type=float, default=3600.0,
                           help="keep anything written or superseded in the last N seconds (default 3600; longer than any publish)")
    _use_parsers(sub)
    s = sub.add_parser("server", help="where the local Prefect server that runs reuse is; `stop` stops it (flows/server.py)")
    s.add_argument("action", nargs="?", choices=["status", "stop"], default="status")
    return p


def _server(action: str) -> int:
    from flows.server import healthy, prefect_home, read_record, stop

    home = prefect_home()
    rec = read_record(home)
    if action == "stop":
        rec = stop(home, on_wait=lambda: print("rlhf: waiting for the runs using the server to finish"))
        print(f"rlhf: stopped the local Prefect server at {rec['api']}" if rec else f"rlhf: no local Prefect server ({home})")
        return 0
    if rec is None:
        print(f"rlhf: no local Prefect server ({home}); the next `rlhf run` starts one")
        return 0
    print(f"rlhf: local Prefect server at {rec['api']} ({'answering' if healthy(rec['api']) else 'NOT answering'}; "
          f"watchdog pid {rec['pid']}, stops after {rec['idle_s']:g} s unused)")
    return 0


def _use_parsers(sub) -> None:
    """``ls``, ``export``, ``generate``: read the store named by the config (flows/use.py)."""
    for name, helptext in (("ls", "list the store's artifacts: stage, key, inputs (lineage), created time, headline metrics"),
                           ("export", "write a stage's policy as a Hugging Face model folder (LoRA merged) or its PEFT adapter"),
                           ("generate", "sample responses to prompts from a stage's policy")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--config", help="YAML file; only its store section is read")
        s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="e.g. --set store.uri=s3://bucket/rlhf")
        s.set_defaults(refresh=[])
        if name == "ls":
            continue
        s.add_argument("--stage", default="ppo", choices=["sft", "ppo"], help="whose policy (default ppo)")
        s.add_argument("--run", default="latest", help="'latest' (newest artifact of the stage) or its key / key hash prefix (see rlhf ls)")
        if name == "export":
            s.add_argument("--out", required=True, help="folder to write (new or empty)")
            s.add_argument("--adapter-only", action="store_true", help="write the PEFT adapter instead of the merged model")
        else:
            s.add_argument("prompt", nargs="+", help="one or more prompts")
            s.add_argument("--max-new-tokens", type=int, default=48)
            s.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")


def _use(args) -> int:
    try:
        return _use_store(args)
    except ValueError as e:
        print(f"rlhf: {e}", file=sys.stderr)
        return 2


def _use_store(args) -> int:
    from flows import use
    from flows.rlhf import open_store

    store = open_store(_load(args))
    if args.cmd == "ls":
        rows = use.list_artifacts(store)
        print(use.format_ls(rows) if rows else f"rlhf: no artifacts in {store.uri}")
        return 0
    key = use.find_artifact(store, args.stage, args.run)
    if args.cmd == "export":
        out = use.export_model(store, key, args.out, adapter_only=args.adapter_only)
        print(f"rlhf: {store.uri_of(key)} -> {out} ({'PEFT adapter' if args.adapter_only else 'merged model'})")
        return 0
    for prompt, response in zip(args.prompt, use.generate(store, key, args.prompt, args.max_new_tokens, args.greedy)):
        print(f"### {prompt}\n{response}\n")
    return 0


def _load(args):
    from flows.config import load_config

    overrides = list(args.set)
    if args.refresh:
        overrides.append("refresh=" + json.dumps(args.refresh))
    return load_config(args.config, overrides)


def main(argv: list[str] | None = None) -> int:
    from flows.config import ConfigError
    from flows.console import setup_cli

    args = _parser().parse_args(argv)
    if args.cmd == "server":
        return _server(args.action)
    setup_cli(args.cmd)  # environment, console handler, progress bars or plain lines (flows/console.py)
    try:
        if args.cmd in ("ls", "export", "generate"):
            return _use(args)  # a bad --stage/--run/--out is a ValueError: exit 2 with the message
        cfg = _load(args)
        if args.cmd in ("config", "run"):  # resolved for this machine's GPUs; `serve` resolves where each run runs
            from flows.config import describe_resources, local_gpus, resolve_resources

            gpus = local_gpus(cfg.ray)
            cfg = resolve_resources(cfg, gpus)
        if args.cmd == "config":
            print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
            print(f"# {describe_resources(cfg, gpus)}")
            return 0
        if args.cmd == "verify":
            return _verify(cfg)
        if args.cmd == "gc":
            return _gc(cfg, args.yes, args.grace_s)
        from flows.preflight import preflight

        preflight(cfg)
    except ConfigError as e:
        print(f"rlhf: {e}", file=sys.stderr)
        return 2
    from flows.server import LocalPrefectServer

    # The server first: Prefect reads PREFECT_API_URL when it is imported.
    with LocalPrefectServer() as server:
        if server.api:
            print(f"rlhf: local Prefect server at {server.api} ({'started; ' if server.started else ''}"
                  "stays up for the UI and the next run, `rlhf server stop` stops it; set PREFECT_API_URL to use your own)")
        from flows.rlhf import rlhf

        if args.cmd == "serve":
            rlhf.serve(name="full", parameters={"config": cfg.model_dump(mode="json")}, cron=args.cron)
            return 0
        return _run(rlhf, cfg)


def _verify(cfg) -> int:
    from storage.store import ArtifactCorrupt, ArtifactStore

    store = ArtifactStore(cfg.store.resolved_uri(), cfg.store.storage_options)
    bad = 0
    for key in store.list():
        try:
            store.verify(key, again=True)
            print(f"ok       {store.uri_of(key)}")
        except (ArtifactCorrupt, FileNotFoundError) as e:
            bad += 1
            print(f"CORRUPT  {e}")
    print(f"rlhf verify: {bad} of {len(store.list())} artifacts failed their checksums")
    return 1 if bad else 0


def _gc(cfg, yes: bool, grace_s: float) -> int:
    from storage.gc import collect, find_garbage
    from storage.store import ArtifactStore

    if grace_s < 0:
        print(f"rlhf: gc --grace-s ({grace_s:g}): must be >= 0 seconds; the default 3600 keeps the last hour's writes", file=sys.stderr)
        return 2
    store = ArtifactStore(cfg.store.resolved_uri(), cfg.store.storage_options)
    garbage = find_garbage(store, grace_s)
    done = collect(store, garbage) if yes else garbage
    for g in done:
        print(f"{'deleted' if yes else 'would delete'}  {store.uri}/{g.path}  {g.nbytes} bytes  ({g.why})")
    total = sum(g.nbytes for g in done)
    print(f"rlhf gc: {'deleted' if yes else 'would delete'} {len(done)} folders, {total} bytes, in {store.uri}"
          + ("" if yes or not done else "; run with --yes to delete them"))
    return 0


def _run(rlhf, cfg) -> int:
    from prefect.logging.handlers import APILogWorker

    t0 = time.time()
    try:
        refs = rlhf(cfg)
    finally:
        APILogWorker.drain_all(timeout=5)  # before the local server stops
    print(f"\nrlhf: done in {time.time() - t0:.1f}s")
    for stage, ref in refs.items():
        print(f"  {stage:5s} {ref.kind:14s} {ref.uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
