"""GPU placement chosen for the GPUs there are, judged before any model loads; the shared KL
reference. The resolution is a pure function of (config, number of GPUs), so every GPU count is
tested here on CPU by passing it in."""

from __future__ import annotations

import copy

import pytest
import torch

from flows.config import ConfigError, PipelineConfig, describe_resources, load_config, resolve_resources
from tasks.ppo.config import ROLES, PPOConfig, check_gpu_fit, gpus_needed, resolve_placement


def shares(cfg: PPOConfig) -> dict[str, float]:
    return {r: cfg.role(r).gpus_per_worker for r in ROLES}


def test_cpu_machine_stays_as_before():
    cfg = resolve_resources(PipelineConfig(), 0)
    assert {s: r.num_gpus for s, r in cfg.resources.items()} == {"data": 0.0, "sft": 0.0, "rm": 0.0, "ppo": 0.0}
    assert shares(cfg.ppo) == dict.fromkeys(ROLES, 0.0) and cfg.ppo.colocate is False
    assert gpus_needed(cfg.ppo) == 0
    assert resolve_resources(cfg, 0) == cfg  # resolving twice changes nothing


def test_one_gpu_sft_and_rm_share_it_and_ppo_roles_colocate():
    cfg = resolve_resources(PipelineConfig(), 1)
    assert {s: r.num_gpus for s, r in cfg.resources.items()} == {"data": 0.0, "sft": 0.5, "rm": 0.5, "ppo": 0.0}
    # shared reference (default): three started roles; `initial` reserves no GPU
    assert shares(cfg.ppo) == {"actor": 0.3333, "critic": 0.3333, "initial": 0.0, "reward": 0.3333}
    assert cfg.ppo.colocate is True and gpus_needed(cfg.ppo) == 1
    # a LoRA critic serving the reward model too: two started roles, half a GPU each
    lora = resolve_placement(PPOConfig(critic_lora_rank=8), 1)
    assert lora.started_roles == ("actor", "critic") and shares(lora) == {"actor": 0.5, "critic": 0.5, "initial": 0.0, "reward": 0.0}
    sep = resolve_placement(PPOConfig(reference="separate"), 1)
    assert shares(sep) == dict.fromkeys(ROLES, 0.25) and sep.started_roles == ROLES
    print(f"\n{describe_resources(cfg, 1)}")


def test_enough_gpus_give_every_worker_its_own():
    cfg = resolve_resources(PipelineConfig(), 8)
    assert cfg.resources["sft"].num_gpus == cfg.resources["rm"].num_gpus == 1.0
    assert shares(cfg.ppo) == {"actor": 1.0, "critic": 1.0, "initial": 0.0, "reward": 1.0} and not cfg.ppo.colocate
    assert gpus_needed(cfg.ppo) == 3


@pytest.mark.parametrize("gpus", [1, 2, 3])
def test_more_workers_than_gpus_pack_onto_them(gpus):
    """4 actor and 2 critic workers: colocated, c = ceil(4 / gpus) bundles per GPU."""
    cfg = resolve_placement(PPOConfig(rollout_batch_size=32, train_batch_size=4, actor={"num_workers": 4},
                                      critic={"num_workers": 2}, reference="separate"), gpus)
    assert cfg.colocate is True
    assert gpus_needed(cfg) <= gpus
    check_gpu_fit(cfg, gpus, "here")


def test_written_values_are_kept_and_mixed_ones_judged():
    cfg = resolve_placement(PPOConfig(actor={"gpus_per_worker": 0.5}), 1)
    assert cfg.actor.gpus_per_worker == 0.5 and cfg.critic.gpus_per_worker == 0.3333
    with pytest.raises(ValueError, match=r"bundle 0 \(worker 0 of every role\) asks for 1.1666 GPUs"):
        check_gpu_fit(cfg, 1, "this machine")  # 0.5 + 2 x 0.3333 > 1 in one colocated bundle
    apart = resolve_placement(PPOConfig(actor={"gpus_per_worker": 0.5}, colocate=False), 1)
    with pytest.raises(ValueError, match=r"ppo roles need 2 GPU\(s\) as placed .* has 1: lower ppo.<role>.gpus_per_worker"):
        check_gpu_fit(apart, 1, "this machine")  # 0.5 + 0.3333 fit one GPU, the second 0.3333 not
    # sixteen 0.25-GPU workers, not colocated: four per GPU
    many = resolve_placement(PPOConfig(rollout_batch_size=32, train_batch_size=4, colocate=False,
                                       **{r: {"num_workers": 4, "gpus_per_worker": 0.25} for r in ROLES}), 4)
    assert gpus_needed(many) == 4
    with pytest.raises(ValueError, match=r"need 4 GPU\(s\).* has 3"):
        check_gpu_fit(many, 3, "here")
    whole = resolve_placement(PPOConfig(colocate=True, **{r: {"gpus_per_worker": 0.5} for r in ROLES}), 2)
    assert gpus_needed(whole) == 2  # a colocated bundle of whole GPUs: Ray gives its workers distinct ones
    check_gpu_fit(whole, 2, "here")
    odd = resolve_placement(PPOConfig(colocate=True, actor={"gpus_per_worker": 1.0}, critic={"gpus_per_worker": 0.5}), 4)
    with pytest.raises(ValueError, match=r"bundle 0 \(worker 0 of every role\) asks for 2.5 GPUs.*sum to <= 1"):
        check_gpu_fit(odd, 4, "here")


def test_stage_gpus_stay_off_where_the_stage_asks_its_workers_or_the_cpu():
    cfg = resolve_resources(load_config(overrides=["sft.num_workers=2", "rm.device=cpu"]), 1)
    assert cfg.resources["sft"].num_gpus == 0.0 and cfg.resources["rm"].num_gpus == 0.0
    kept = resolve_resources(load_config(overrides=["resources.sft.num_gpus=1"]), 1)
    assert kept.resources["sft"].num_gpus == 1.0 and kept.resources["rm"].num_gpus == 0.5
    cluster = resolve_resources(PipelineConfig(), None)  # a cluster: PPO resolves against its total in train_ppo
    assert cluster.ppo.actor.gpus_per_worker is None and cluster.resources["sft"].num_gpus == 0.0


def test_preflight_refuses_what_the_local_machine_cannot_hold():
    from flows.preflight import check_local_gpus

    for overrides, message in [
        (["ray.num_gpus=1", "resources.sft.num_gpus=2"], r"`resources.sft.num_gpus` \(2.0\): this machine has 1 GPU"),
        (["ray.num_gpus=1", "ppo.actor.gpus_per_worker=0.75", "ppo.colocate=false"], r"ppo roles need 2 GPU\(s\) .* this machine \(a local Ray\) has 1"),
        (["ray.num_gpus=0", "ppo.critic.gpus_per_worker=0.5"], r"`ppo.critic.gpus_per_worker` \(0.5\): no GPU here"),
    ]:
        with pytest.raises((ConfigError, ValueError), match=message):
            check_local_gpus(load_config(overrides=overrides))
    check_local_gpus(load_config(overrides=["ray.num_gpus=1"]))  # the defaults fit one GPU


def test_shared_reference_is_the_frozen_sft_adapter_on_the_actors_base(tmp_path):
    """The reference adapter gives the SFT policy's log-probs exactly while the trained adapter
    moves, switching it changes no requires_grad, and the saved adapter is the trained one only."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.ppo.generation import forward_actions
    from tasks.ppo.roles import REFERENCE_ADAPTER, active_adapter

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0))
    sft = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    sft.save_pretrained(tmp_path / "sft")
    model = PeftModel.from_pretrained(base, str(tmp_path / "sft"), is_trainable=True).eval()
    model.load_adapter(str(tmp_path / "sft"), adapter_name=REFERENCE_ADAPTER, is_trainable=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)
    ids = torch.randint(1, 64, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)

    def logp(reference: bool) -> torch.Tensor:
        with torch.no_grad():
            if reference:
                with active_adapter(model, REFERENCE_ADAPTER):
                    return forward_actions(model, ids, mask, 4)[0]
            return forward_actions(model, ids, mask, 4)[0]

    assert torch.equal(logp(True), logp(False))  # KL exactly 0 before any update
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    sft_policy = logp(True)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad and "lora_B" in n:
                p.add_(0.5)
    assert not torch.allclose(logp(False), sft_policy) and torch.equal(logp(True), sft_policy)
    model.save_pretrained(tmp_path / "out", selected_adapters=["default"])
    assert not (tmp_path / "out" / REFERENCE_ADAPTER).exists()


def test_weights_and_optimizer_state_that_cannot_fit_are_refused_with_the_fix():
    """The 8B shape (bench/gpu_shapes.py: 8.03B parameters, body 7.50B) on one 140 GiB H200: a
    full-parameter fp32 critic with Adam state alone is ~112 GiB; a LoRA critic fits."""
    from tasks.ppo.config import check_gpu_memory, weight_memory_gib

    lm, body = 8_030_261_248, 7_504_924_672
    full = resolve_placement(PPOConfig(), 1)
    est = weight_memory_gib(full, lm, body, fast_copy=True)
    assert round(est["critic"]) == 112 and round(est["actor"]) == 30 and set(est) == {"actor", "critic", "reward"}
    with pytest.raises(ValueError, match=r"need at least 170 GiB .* 1 GPU\(s\) of 140 GiB hold 140: set ppo.critic_lora_rank"):
        check_gpu_memory(full, est, 1, 140.0)
    lora = resolve_placement(PPOConfig(critic_lora_rank=16), 1)
    est = weight_memory_gib(lora, lm, body, fast_copy=True)
    assert set(est) == {"actor", "critic"} and round(sum(est.values())) == 44
    check_gpu_memory(lora, est, 1, 140.0)
    assert weight_memory_gib(resolve_placement(PPOConfig(), 0), lm, body, True) == {}  # CPU roles: nothing on a GPU
