"""Register deployment ``rlhf/full`` on a process work pool (created if missing).

    .venv/bin/python deployments/deploy.py [--pool rlhf-local] [--cron "0 3 * * 0"] [--concurrency 1] [--on-collision enqueue]
                                           [--config cfg.yaml] [--set k=v ...]
    .venv/bin/prefect worker start --pool rlhf-local          # runs the flow runs, from this checkout
    .venv/bin/prefect deployment run rlhf/full --watch [--params '{"config": {...}}']

The deployment's parameter is the whole PipelineConfig (Prefect renders it as a form in the UI);
the values given here become its defaults. With --cron, the schedule retrains on that cadence:
stages whose inputs did not change are reused from the artifact store.

Runs of the deployment never overlap beyond ``--concurrency`` (default 1): a scheduled retrain
and a manual run would fight over one GPU and one store key. A run that finds the limit taken
waits (``--on-collision enqueue``, shown as AwaitingConcurrencySlot) and then finds the first
run's artifacts cached, or is cancelled (``cancel``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


async def ensure_work_pool(name: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    async with get_client() as client:
        try:
            await client.create_work_pool(WorkPoolCreate(name=name, type="process"))
        except ObjectAlreadyExists:
            pass


COLLISIONS = {"enqueue": "ENQUEUE", "cancel": "CANCEL_NEW"}


def deploy(pool: str = "rlhf-local", cron: str | None = None, config_path: str | None = None,
           overrides: list[str] = (), name: str = "full", concurrency: int = 1, on_collision: str = "enqueue") -> str:
    sys.path.insert(0, str(ROOT))
    from prefect.client.schemas.objects import ConcurrencyLimitConfig

    from flows.config import load_config
    from flows.rlhf import rlhf

    if concurrency < 1:
        raise ValueError(f"--concurrency ({concurrency}): the most runs of rlhf/{name} at once must be >= 1 (1: never overlap)")
    if on_collision not in COLLISIONS:
        raise ValueError(f"--on-collision ({on_collision!r}): expected one of {sorted(COLLISIONS)} "
                         "(enqueue: a run waits for a slot; cancel: it is cancelled)")
    cfg = load_config(config_path, overrides)
    asyncio.run(ensure_work_pool(pool))
    flow = rlhf.from_source(source=str(ROOT), entrypoint="deployments/entrypoint.py:rlhf")
    deployment_id = flow.deploy(
        name=name, work_pool_name=pool, cron=cron, parameters={"config": cfg.model_dump(mode="json")},
        description="RLHF: data prep -> PEFT LoRA SFT -> reward model -> PPO on Ray", print_next_steps=False,
        build=False, push=False,
        concurrency_limit=ConcurrencyLimitConfig(limit=concurrency, collision_strategy=COLLISIONS[on_collision]),
    )
    return str(deployment_id)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool", default="rlhf-local", help="process work pool (created if missing)")
    p.add_argument("--cron", help="retraining schedule, e.g. '0 3 * * 0' (Sundays 03:00)")
    p.add_argument("--concurrency", type=int, default=1, help="most runs of the deployment at once (default 1)")
    p.add_argument("--on-collision", default="enqueue", choices=sorted(COLLISIONS),
                   help="a run over the limit waits for a slot (enqueue, default) or is cancelled")
    p.add_argument("--config", help="YAML config whose values become the deployment's defaults")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    try:
        deployment_id = deploy(a.pool, a.cron, a.config, a.set, concurrency=a.concurrency, on_collision=a.on_collision)
    except ValueError as e:
        print(f"deploy: {e}", file=sys.stderr)
        return 2
    print(f"deployment rlhf/full: {deployment_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
