"""Supervised fine-tuning with a PEFT LoRA adapter: the ``sft_adapter`` artifact.

``train_sft`` is a plain function (no Prefect). With ``num_workers > 1`` the same per-rank
function runs on Ray actors in one torch.distributed group (DDP, gloo on CPU); rank 0 writes.

Resume: every ``eval_every`` steps the adapter, tokenizer and ``trainer_state.pt`` (optimizer,
scheduler, step, every rank's RNG) are published as an in-progress artifact at
``<key>-partial`` (kind ``sft_checkpoint``). A rerun with ``resume`` loads it with
``PeftModel.from_pretrained(..., is_trainable=True)`` -- without that flag PEFT loads the
adapter frozen and "resumed" training silently learns nothing (the seed's bug) -- and continues
from the same step, data position and RNG, so the result equals an uninterrupted run. The
partial artifact is deleted once the final one is published.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch

from storage.store import ArtifactRef, ArtifactStore
from tasks.common.model import ModelConfig, load_causal_lm, load_tokenizer, pick_device, placement_record, checkpoint_blocks
from tasks.data.dataset import collate_lm, read_jsonl
from tasks.common import loop
from tasks.common.tracking import Tracker, TrackingConfig
from tasks.sft.config import SFTConfig
from tasks.sft.key import sft_key
from tasks.common.lora import lora_config, model_skeleton, resolve_target_modules, save_adapter
from tasks.sft.loss import IGNORE_INDEX, causal_lm_loss

logger = logging.getLogger("rlhf.sft")

KIND = "sft_adapter"
CHECKPOINT_KIND = "sft_checkpoint"
def partial_key(key: str) -> str:
    return f"{key}-partial"


def train_sft(cfg: SFTConfig, model: ModelConfig, store: ArtifactStore, data: ArtifactRef, seed: int,
              *, key: str | None = None, stop_after: int | None = None, force: bool = False,
              tracking: TrackingConfig | None = None) -> ArtifactRef:
    """Train a LoRA adapter on ``data``'s ``sft_train`` split and publish it; returns its ref.

    ``key`` is the one the flow computed (``sft_key``); None computes it. An artifact already
    complete at the key is returned as it is. ``stop_after`` ends the run
    after that many optimizer steps (counted from step 0) as a preempted job would: the
    checkpoint is written and its ref (kind ``sft_checkpoint``) returned instead of the final
    adapter; the next call with ``resume`` continues from it. The schedule still spans the full
    run, so stopping changes nothing but where the work happens. ``tracking``: where the scalars
    go besides the artifact's ``tensorboard/`` (tasks/common/tracking.py).
    """
    if data.kind != "dataset":
        raise ValueError(f"train_sft data {data.uri!r} is a {data.kind!r} artifact: pass the ref prepare_data returned (kind 'dataset')")
    key = key or sft_key(cfg, model, data, seed)
    if not force and store.is_good(key):  # a damaged artifact is rebuilt
        logger.info("sft: %s already published, reusing it", store.uri_of(key))
        return store.ref(key)
    targets = _check_inputs(cfg, model, store, data)
    args = (cfg, model, store, data, seed, key, targets, stop_after, tracking, force)
    if cfg.num_workers > 1:
        from tasks.common.dist import run_data_parallel

        out = run_data_parallel(_fit, cfg.num_workers, *args, num_gpus=1.0 if loop.wants_gpu(cfg.device) else 0.0)[0]
    else:
        out = _fit(*args)
    return ArtifactRef(**out)


def _check_inputs(cfg: SFTConfig, model: ModelConfig, store: ArtifactStore, data: ArtifactRef) -> list[str] | str:
    """Every config/data error before a weight is loaded; returns the resolved LoRA targets."""
    loop.check_store_reachable("sft", cfg.num_workers, store)
    pick_device(cfg.device)
    with open(store.fetch(data) / "sft_train.jsonl", "rb") as f:
        n = sum(1 for line in f if line.strip())
    loop.check_batches("sft", n, cfg.batch_size, cfg.accumulation_steps, cfg.num_workers, "sft_train.jsonl")
    return resolve_target_modules(cfg.target_modules, model_skeleton(model), builtin=model.is_builtin)


def _fit(cfg, model_cfg, store, data, seed, key, targets, stop_after, tracking, force=False) -> dict | None:
    """One rank's training run (the whole run with one process). Rank 0 returns the ref dict."""
    from peft import PeftModel, get_peft_model

    rank, world = loop.rank_world()
    device = pick_device(cfg.device)
    data_dir = store.fetch(data)
    train, evals = read_jsonl(data_dir / "sft_train.jsonl"), read_jsonl(data_dir / "sft_eval.jsonl")
    pad_id = load_tokenizer(model_cfg, str(data_dir / "tokenizer")).pad_token_id
    spe = loop.steps_per_epoch(len(train), cfg.batch_size, cfg.accumulation_steps, world)
    total = cfg.max_steps or spe * cfg.max_epochs

    torch.manual_seed(seed)
    ckpt = store.fetch(partial_key(key)) if cfg.resume and store.exists(partial_key(key)) else None
    base = load_causal_lm(model_cfg, device)
    if ckpt is not None:
        # is_trainable=True: from_pretrained loads adapters frozen by default.
        model = PeftModel.from_pretrained(base, str(ckpt / "adapter"), is_trainable=True)
    else:
        model = get_peft_model(base, lora_config(cfg, targets))
    checkpointing = checkpoint_blocks(model, cfg.gradient_checkpointing, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = loop.warmup_cosine(opt, int(cfg.warmup_ratio * total), total)
    if ckpt is not None:
        state = _restore(ckpt / "trainer_state.pt", opt, sched, rank, world)
        state["resumed_from_step"] = state["step"]
        logger.info("sft: resuming %s at step %d/%d", store.uri_of(partial_key(key)), state["step"], total)
    else:
        state = {"step": 0, "window_losses": [], "eval_history": [], "resumed_from_step": 0,
                 "eval_loss_start": evaluate(model, evals, pad_id, cfg.batch_size, device)}
    ddp = loop.wrap_ddp(model, device)
    config = {"sft": cfg.model_dump(mode="json"), "model": model_cfg.model_dump(mode="json"), "seed": seed,
              "target_modules": targets, "world_size": world}
    with Tracker("sft", tracking, config, total, active=rank == 0) as tracker:
        # a resumed run's curve starts with the evals it already made (per-step lines before it are not kept)
        for step, eval_loss in [[0, state["eval_loss_start"]], *state["eval_history"]]:
            tracker.log(step, {"sft/eval_loss": eval_loss})

        def save(out_dir: Path) -> None:
            rng = loop.gather_rng()  # collective: every rank takes part
            if rank == 0:
                _save(model, data_dir / "tokenizer", opt, sched, state, rng, spe, out_dir)

        end = min(total, stop_after) if stop_after else total
        throughput = _train_loop(cfg, ddp, model, params, opt, sched, state, train, evals, pad_id, seed, spe, total, end,
                                 device, lambda: _publish_checkpoint(store, key, data, save, rank), tracker)
        if end < total:
            ref = _publish_checkpoint(store, key, data, save, rank)
            return ref.model_dump() if rank == 0 else None

        metrics = {"sft/eval_loss_start": state["eval_loss_start"], "sft/eval_loss": state["eval_history"][-1][1],
                   "sft/train_loss": state["train_loss"], "sft/steps": state["step"], "sft/tokens_per_s": throughput,
                   "sft/ddp_weight_max_diff": loop.max_weight_diff(params), "sft/eval_history": state["eval_history"],
                   "sft/resumed_from_step": state["resumed_from_step"], "sft/gradient_checkpointing": checkpointing}
        with tempfile.TemporaryDirectory() as tmp:
            save(Path(tmp))
            if rank != 0:
                return None
            tracker.write_into(tmp)
            ref = store.publish(key, tmp, kind=KIND, config=config, inputs={"data": data}, metrics=metrics,
                                extra={"placement": placement_record(device)}, keep_existing=not force)
        tracker.finish(ref.uri)
        store.delete(partial_key(key))
        logger.info("sft: published %s eval_loss %.4f -> %.4f", ref.uri, metrics["sft/eval_loss_start"], metrics["sft/eval_loss"])
        return ref.model_dump()


def _train_loop(cfg, ddp, model, params, opt, sched, state, train, evals, pad_id, seed, spe, total, end, device,
                checkpoint, tracker) -> float:
    """Optimizer steps from ``state['step']`` to ``end``; evaluates and checkpoints on the way.
    Returns tokens/s (non-pad input tokens over all ranks)."""
    rank, world = loop.rank_world()
    acc, batches, epoch_of_batches = cfg.accumulation_steps, None, None
    t0, tokens = time.perf_counter(), 0
    while state["step"] < end:
        epoch, pos = divmod(state["step"], spe)
        if epoch != epoch_of_batches:
            batches, epoch_of_batches = loop.epoch_batches(len(train), cfg.batch_size, seed, epoch, rank, world), epoch
        micro = [collate_lm([train[i] for i in b], pad_id) for b in batches[pos * acc:(pos + 1) * acc]]
        lr = sched.get_last_lr()[0]
        loss, grad_norm = _train_step(ddp, micro, params, opt, sched, cfg.grad_clip, device)
        tokens += sum(int(m["attention_mask"].sum()) for m in micro) * world
        state["step"] += 1
        state["window_losses"].append(loss)
        step = state["step"]
        tracker.log(step, {"sft/loss": loss, "sft/lr": lr, "sft/grad_norm": grad_norm,
                           "sft/tokens_per_s": tokens / (time.perf_counter() - t0)})
        if rank == 0 and (step % cfg.log_every == 0 or step == total):
            logger.info("sft step %d/%d loss %.4f lr %.3e tokens/s %.0f", step, total, loss,
                        sched.get_last_lr()[0], tokens / (time.perf_counter() - t0))
        if step % cfg.eval_every == 0 or step == total:
            eval_loss = evaluate(model, evals, pad_id, cfg.batch_size, device)
            state["eval_history"].append([step, eval_loss])
            tracker.log(step, {"sft/eval_loss": eval_loss})
            state["train_loss"] = sum(state["window_losses"]) / len(state["window_losses"])
            state["window_losses"] = []
            if rank == 0:
                logger.info("sft eval step %d eval_loss %.4f", step, eval_loss)
            if step < end:
                checkpoint()
    return tokens / max(time.perf_counter() - t0, 1e-9)


def _train_step(ddp, micro: list[dict], params, opt, sched, grad_clip: float, device: str) -> tuple[float, float]:
    """One optimizer step over ``micro`` batches; returns the step's mean token loss (all ranks)
    and the gradient norm before clipping.

    Each micro-batch contributes its NLL sum over the token count of the whole step on all
    ranks (times world size, which DDP's gradient mean divides out again), so the gradient is
    that of the mean over every label token of the step, however tokens fall into batches.
    """
    world = loop.rank_world()[1]
    window = loop.all_reduce(torch.tensor(float(sum(int((m["labels"][:, 1:] != IGNORE_INDEX).sum()) for m in micro))))
    nll = torch.zeros(())
    for i, m in enumerate(micro):
        m = {k: v.to(device) for k, v in m.items()}
        with loop.no_sync(ddp, last_micro=i == len(micro) - 1):
            with loop.autocast(device):
                logits = ddp(input_ids=m["input_ids"], attention_mask=m["attention_mask"]).logits
            out = causal_lm_loss(logits, m["labels"])
            (out.nll_sum * world / window.clamp(min=1).to(device)).backward()
        nll += out.nll_sum.detach().float().cpu()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(loop.all_reduce(nll) / window.clamp(min=1)), grad_norm


@torch.no_grad()
def evaluate(model, records: list[dict], pad_id: int, batch_size: int, device: str) -> float:
    """Mean token loss over ``records`` (sharded across ranks, sums all-reduced); eval mode."""
    rank, world = loop.rank_world()
    was_training = model.training
    model.eval()
    nll, n = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    mine = records[rank::world]
    for i in range(0, len(mine), batch_size):
        b = {k: v.to(device) for k, v in collate_lm(mine[i:i + batch_size], pad_id).items()}
        with loop.autocast(device):
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        out = causal_lm_loss(logits, b["labels"])
        nll += out.nll_sum.double().cpu()
        n += out.n_tokens.double().cpu()
    loop.all_reduce(nll), loop.all_reduce(n)
    model.train(was_training)
    return float(nll / n.clamp(min=1))


def _save(model, tokenizer_dir: Path, opt, sched, state: dict, rng: list, spe: int, out: Path) -> None:
    # The base weights stay untouched, so an lm_head target need not copy the embedding into the adapter.
    save_adapter(model, out / "adapter", save_embedding_layers=False)
    shutil.copytree(tokenizer_dir, out / "tokenizer")
    epoch, position = divmod(state["step"], spe)
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": state["step"],
                "epoch": epoch, "position": position, "rng": rng, "window_losses": state["window_losses"],
                "eval_history": state["eval_history"], "eval_loss_start": state["eval_loss_start"],
                "train_loss": state.get("train_loss")}, out / "trainer_state.pt")


def _restore(path: Path, opt, sched, rank: int, world: int) -> dict:
    saved = torch.load(path, weights_only=True)
    assert len(saved["rng"]) == world, "the key includes num_workers, so a checkpoint has one RNG state per rank"
    opt.load_state_dict(saved["optimizer"])
    sched.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"][rank])
    return {k: saved[k] for k in ("step", "window_losses", "eval_history", "eval_loss_start", "train_loss")}


def _publish_checkpoint(store: ArtifactStore, key: str, data: ArtifactRef, save, rank: int) -> ArtifactRef | None:
    with tempfile.TemporaryDirectory() as tmp:
        save(Path(tmp))
        if rank != 0:
            return None
        return store.publish(partial_key(key), tmp, kind=CHECKPOINT_KIND, inputs={"data": data})
