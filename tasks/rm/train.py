"""Reward model training on preference pairs: the ``reward_model`` artifact.

``train_reward_model`` is a plain function (no Prefect). Full-parameter by default (the seed's
advice); ``lora_rank > 0`` puts LoRA on the body, the head trains in full, and the LoRA is
merged before saving, so readers always get one plain state dict. ``num_workers > 1`` runs the
same per-rank function on Ray actors under DDP (gloo on CPU); rank 0 publishes.
"""

from __future__ import annotations

import logging
import tempfile

import torch

from storage.store import ArtifactRef, ArtifactStore
from tasks.common.model import ModelConfig, load_tokenizer, pick_device, placement_record, checkpoint_blocks
from tasks.data.dataset import collate_pairs, read_jsonl
from tasks.rm.config import RewardConfig
from tasks.rm.key import rm_key
from tasks.rm.loss import pairwise_loss
from tasks.rm.model import build_reward_model, save_reward_model
from tasks.common import loop
from tasks.common.tracking import Tracker, TrackingConfig
from tasks.common.lora import lora_config, model_skeleton, resolve_target_modules

logger = logging.getLogger("rlhf.rm")

KIND = "reward_model"
def train_reward_model(cfg: RewardConfig, model: ModelConfig, store: ArtifactStore, data: ArtifactRef, seed: int,
                       *, key: str | None = None, force: bool = False, tracking: TrackingConfig | None = None) -> ArtifactRef:
    """Train a sequence scorer on ``data``'s ``pref_train`` pairs and publish it; returns its ref.

    ``key`` is the one the flow computed (``rm_key``); None computes it. An artifact already
    complete at the key is returned as it is. ``tracking``: where the scalars go besides the
    artifact's ``tensorboard/`` (tasks/common/tracking.py).
    """
    if data.kind != "dataset":
        raise ValueError(f"train_reward_model data {data.uri!r} is a {data.kind!r} artifact: pass the ref prepare_data returned (kind 'dataset')")
    key = key or rm_key(cfg, model, data, seed)
    if not force and store.is_good(key):  # a damaged artifact is rebuilt
        logger.info("rm: %s already published, reusing it", store.uri_of(key))
        return store.ref(key)
    targets = _check_inputs(cfg, model, store, data)
    args = (cfg, model, store, data, seed, key, targets, tracking, force)
    if cfg.num_workers > 1:
        from tasks.common.dist import run_data_parallel

        out = run_data_parallel(_fit, cfg.num_workers, *args, num_gpus=1.0 if loop.wants_gpu(cfg.device) else 0.0)[0]
    else:
        out = _fit(*args)
    return ArtifactRef(**out)


def _check_inputs(cfg: RewardConfig, model: ModelConfig, store: ArtifactStore, data: ArtifactRef):
    loop.check_store_reachable("rm", cfg.num_workers, store)
    pick_device(cfg.device)
    with open(store.fetch(data) / "pref_train.jsonl", "rb") as f:
        n = sum(1 for line in f if line.strip())
    loop.check_batches("rm", n, cfg.batch_size, cfg.accumulation_steps, cfg.num_workers, "pref_train.jsonl")
    if cfg.lora_rank == 0:
        return None
    return resolve_target_modules(cfg.target_modules, model_skeleton(model, body_only=True), field="rm.target_modules")


def _fit(cfg, model_cfg, store, data, seed, key, targets, tracking, force=False) -> dict | None:
    """One rank's training run (the whole run with one process). Rank 0 returns the ref dict."""
    rank, world = loop.rank_world()
    device = pick_device(cfg.device)
    data_dir = store.fetch(data)
    train, evals = read_jsonl(data_dir / "pref_train.jsonl"), read_jsonl(data_dir / "pref_eval.jsonl")
    pad_id = load_tokenizer(model_cfg, str(data_dir / "tokenizer")).pad_token_id
    spe = loop.steps_per_epoch(len(train), cfg.batch_size, cfg.accumulation_steps, world)
    total = cfg.max_steps or spe * cfg.max_epochs

    torch.manual_seed(seed)
    lora = lora_config(cfg, targets, task_type="FEATURE_EXTRACTION") if cfg.lora_rank else None
    model = build_reward_model(model_cfg, device, lora)
    checkpointing = checkpoint_blocks(model, cfg.gradient_checkpointing, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = loop.warmup_cosine(opt, int(cfg.warmup_ratio * total), total)
    start = evaluate_rm(model, evals, pad_id, cfg.batch_size, device)
    ddp = loop.wrap_ddp(model, device)
    config = {"rm": cfg.model_dump(mode="json"), "model": model_cfg.model_dump(mode="json"), "seed": seed,
              "target_modules": targets, "world_size": world}
    with Tracker("rm", tracking, config, total, active=rank == 0) as tracker:
        tracker.log(0, {"rm/eval_accuracy": start[0], "rm/eval_margin": start[1]})
        acc, batches, batches_epoch, losses, history = cfg.accumulation_steps, None, None, [], []
        for step in range(total):
            epoch, pos = divmod(step, spe)
            if epoch != batches_epoch:
                batches, batches_epoch = loop.epoch_batches(len(train), cfg.batch_size, seed, epoch, rank, world), epoch
            micro = [collate_pairs([train[i] for i in b], pad_id) for b in batches[pos * acc:(pos + 1) * acc]]
            lr = sched.get_last_lr()[0]
            loss, grad_norm = _train_step(ddp, micro, params, opt, sched, cfg, device)
            losses.append(loss)
            tracker.log(step + 1, {"rm/loss": loss, "rm/lr": lr, "rm/grad_norm": grad_norm})
            if rank == 0 and ((step + 1) % cfg.log_every == 0 or step + 1 == total):
                logger.info("rm step %d/%d loss %.4f lr %.3e", step + 1, total, losses[-1], sched.get_last_lr()[0])
            if (step + 1) % cfg.eval_every == 0 or step + 1 == total:
                history.append([step + 1, *evaluate_rm(model, evals, pad_id, cfg.batch_size, device)])
                tracker.log(step + 1, {"rm/eval_accuracy": history[-1][1], "rm/eval_margin": history[-1][2]})
                if rank == 0:
                    logger.info("rm eval step %d accuracy %.3f margin %.3f", *history[-1])

        window = losses[history[-2][0] if len(history) > 1 else 0:]  # the steps since the previous eval
        metrics = {"rm/eval_accuracy": history[-1][1], "rm/eval_margin": history[-1][2], "rm/train_loss": sum(window) / len(window),
                   "rm/eval_accuracy_start": start[0], "rm/steps": total, "rm/eval_history": history,
                   "rm/ddp_weight_max_diff": loop.max_weight_diff(params), "rm/gradient_checkpointing": checkpointing}
        if rank != 0:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            save_reward_model(model, tmp, data_dir / "tokenizer", extra={"pad_token_id": pad_id})
            tracker.write_into(tmp)
            ref = store.publish(key, tmp, kind=KIND, config=config, inputs={"data": data}, metrics=metrics,
                                extra={"placement": placement_record(device)}, keep_existing=not force)
        tracker.finish(ref.uri)
    logger.info("rm: published %s eval accuracy %.3f -> %.3f", ref.uri, start[0], metrics["rm/eval_accuracy"])
    return ref.model_dump()


def _scores(model, batch: dict, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected rows in one forward pass: (B,), (B,)."""
    ids = torch.cat([batch["chosen_ids"], batch["rejected_ids"]]).to(device)
    mask = torch.cat([batch["chosen_mask"], batch["rejected_mask"]]).to(device)
    with loop.autocast(device):
        r = model(ids, mask)
    return r.float().chunk(2)


def _train_step(ddp, micro: list[dict], params, opt, sched, cfg: RewardConfig, device: str) -> tuple[float, float]:
    """One optimizer step: (mean loss over ranks, gradient norm before clipping); micro-batches hold
    equal pair counts, so the mean of their means is the mean."""
    total = 0.0
    for i, batch in enumerate(micro):
        with loop.no_sync(ddp, last_micro=i == len(micro) - 1):
            out = pairwise_loss(*_scores(ddp, batch, device), margin=cfg.margin)
            (out.loss / len(micro)).backward()
        total += out.loss.item() / len(micro)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(loop.all_reduce(torch.tensor(total)) / loop.rank_world()[1]), grad_norm


@torch.no_grad()
def evaluate_rm(model, records: list[dict], pad_id: int, batch_size: int, device: str) -> tuple[float, float]:
    """(pairwise accuracy, mean r_c - r_r) over ``records``, sharded across ranks; eval mode."""
    rank, world = loop.rank_world()
    was_training = model.training
    model.eval()
    correct, margin, n = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    mine = records[rank::world]
    for i in range(0, len(mine), batch_size):
        r_c, r_r = _scores(model, collate_pairs(mine[i:i + batch_size], pad_id), device)
        correct += (r_c > r_r).sum().double().cpu()
        margin += (r_c - r_r).sum().double().cpu()
        n += len(r_c)
    for t in (correct, margin, n):
        loop.all_reduce(t)
    model.train(was_training)
    return float(correct / n.clamp(min=1)), float(margin / n.clamp(min=1))
