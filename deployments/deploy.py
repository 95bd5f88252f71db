"""Register deployment ``rlhf/full`` on a process work pool (created if missing).

    .venv/bin/python deployments/deploy.py [--pool rlhf-local] [--cron "0 3 * * 0"] [--config cfg.yaml] [--set k=v ...]
    .venv/bin/prefect worker start --pool rlhf-local          # runs the flow runs, from this checkout
    .venv/bin/prefect deployment run rlhf/full --watch [--params '{"config": {...}}']

The deployment's parameter is the whole PipelineConfig (Prefect renders it as a form in the UI);
the values given here become its defaults. With --cron, the schedule retrains on that cadence:
stages whose inputs did not change are reused from the artifact store.
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


def deploy(pool: str = "rlhf-local", cron: str | None = None, config_path: str | None = None,
           overrides: list[str] = (), name: str = "full") -> str:
    sys.path.insert(0, str(ROOT))
    from flows.config import load_config
    from flows.rlhf import rlhf

    cfg = load_config(config_path, overrides)
    asyncio.run(ensure_work_pool(pool))
    flow = rlhf.from_source(source=str(ROOT), entrypoint="deployments/entrypoint.py:rlhf")
    deployment_id = flow.deploy(
        name=name, work_pool_name=pool, cron=cron, parameters={"config": cfg.model_dump(mode="json")},
        description="RLHF: data prep -> PEFT LoRA SFT -> reward model -> PPO on Ray", print_next_steps=False,
        build=False, push=False,
    )
    return str(deployment_id)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool", default="rlhf-local", help="process work pool (created if missing)")
    p.add_argument("--cron", help="retraining schedule, e.g. '0 3 * * 0' (Sundays 03:00)")
    p.add_argument("--config", help="YAML config whose values become the deployment's defaults")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    print(f"deployment rlhf/full: {deploy(a.pool, a.cron, a.config, a.set)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
