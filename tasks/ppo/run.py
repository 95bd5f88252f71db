"""One PPO run's loop body and evaluation over its role groups (``PPORun``), driven by
``tasks.ppo.train.train_ppo``: what one iteration sends where, and what an evaluation measures.

The driver only moves object refs: prompts to the actor workers, rollout refs to the other roles
(each worker one call per scoring method with all of its chunks, ``RoleGroup.deal``; it scores
them in as few forwards as fit) and to the reward terms' Ray tasks, experience refs (made in a
Ray task, tasks/ppo/experience.py) to the learner ranks.
"""

from __future__ import annotations

import logging
import time

import torch

from tasks.common.builtin import score_response
from tasks.ppo.config import PPOConfig
from tasks.ppo.group import RoleGroup

log = logging.getLogger("rlhf.ppo")
EVAL_SEED = 20240601
SAMPLES = 4  # held-out prompts whose responses each evaluation keeps (``eval/samples``)


class PPORun:
    """One PPO run's loop body and evaluation over its role groups."""

    def __init__(self, cfg: PPOConfig, groups: dict[str, RoleGroup], tokenizer, evals: list, builtin: bool,
                 eval_records: list[dict] | None = None):
        import ray

        from tasks.ppo.experience import make_experience
        from tasks.ppo.rewards import score_chunk

        self.cfg, self.g, self.tok, self.evals, self.builtin = cfg, groups, tokenizer, evals, builtin
        self.eval_records = eval_records
        # num_cpus=0: the roles' placement groups may hold every CPU; this short task must not wait
        self.make_experience = ray.remote(make_experience)
        self.score_chunk = ray.remote(score_chunk)
        self.tok_ref = ray.put(tokenizer) if any(r.kind != "model" for r in cfg.rewards) else None
        # the reward as reported: the reward model's score, and the sum of the terms unless that is the model alone
        self.rm_only = [(r.kind, r.weight) for r in cfg.rewards] == [("model", 1.0)]

    def _score(self, rollouts: list, records: list[list[dict]] | None) -> tuple[list, list, list[list]]:
        """(policy (logp, entropy), reference logp, per ``ppo.rewards`` term its scores) refs, one per
        chunk: chunk j to worker j % n, one call per worker and method (``RoleGroup.deal``). The
        reference is the `initial` group's, or with ``ppo.reference`` 'shared' the actor's; a model
        term the `reward` group's, or the critic's when it serves the reward model
        (``ppo.reward_model``); a function or http term a Ray task per chunk (``records[j]``: the
        prompt records of chunk j's rows)."""
        g = self.g
        reference = g.get("initial", g["actor"])
        terms = []
        for i, src in enumerate(self.cfg.rewards):
            if src.kind == "model":
                reward = g.get("reward", g.get("critic"))
                terms.append(reward.deal("score", rollouts))
            else:
                if records is None:
                    raise ValueError(f"ppo.rewards[{i}] (kind {src.kind!r}) needs each prompt's record: pass records")
                terms.append([self.score_chunk.options(num_cpus=src.num_cpus).remote(
                    src, i, r, self.tok_ref, [x["prompt"] for x in recs], _metadata(recs)) for r, recs in zip(rollouts, records)])
        return g["actor"].deal("logprobs", rollouts), reference.deal("reference_logprobs", rollouts), terms

    def iteration(self, it: int, prompts: list[list[int]], kl_ctl, records: list[dict] | None = None) -> dict:
        """One rollout + learn step on ``prompts`` (token ids; ``records``: their prompt records,
        needed by rewards of kind function / http), each answered ``n_samples_per_prompt`` times."""
        import ray

        cfg, g = self.cfg, self.g
        actor, critic = g["actor"], g.get("critic")
        t0 = time.perf_counter()
        # 1. prompts were sampled by the caller (seeded sampler, position checkpointed); each is
        #    repeated n times in place, so a group is n consecutive rows (tasks/ppo/advantages.py)
        n = cfg.n_samples_per_prompt
        prompts = [p for p in prompts for _ in range(n)]
        records = None if records is None else [r for r in records for _ in range(n)]
        assert len(prompts) == cfg.rollout_batch_size, (len(prompts), cfg.rollout_batch_size)
        # 2. deal them to the actor workers; each returns its share as minibatch-sized rollout chunks
        #    (a whole number of groups each: the config makes train_batch_size a multiple of n)
        per = cfg.rollout_batch_size // len(actor)
        k = per // cfg.train_batch_size
        rollouts = []
        for i, w in enumerate(actor.workers):
            out = w.generate.options(num_returns=k).remote(prompts[i * per:(i + 1) * per], k)
            rollouts += [out] if k == 1 else list(out)
        tb = cfg.train_batch_size
        chunk_records = None if records is None else [records[j * tb:(j + 1) * tb] for j in range(len(rollouts))]
        # 3. the rollout refs go straight to the other roles (top-level args: Ray resolves them there),
        #    each worker all of its chunks in one call per method
        policy, ref, terms = self._score(rollouts, chunk_records)
        values = critic.deal("values", rollouts) if critic is not None else []
        ray.wait(rollouts, num_returns=len(rollouts), fetch_local=False)
        t_gen = time.perf_counter()
        # 4. rewards, advantages (ppo.advantage), whitening: in a Ray task, not on the driver
        c = len(rollouts)
        *exps, stats_ref = self.make_experience.options(num_cpus=0, num_returns=c + 1).remote(
            cfg, kl_ctl.value, c, *rollouts, *policy, *ref, *values, *(s for t in terms for s in t))
        stats = ray.get(stats_ref)
        t_score = time.perf_counter()
        # 5. deal experience round-robin to the learner ranks (a chunk, so a group, to one rank);
        #    actor and critic learn in parallel
        a = [w.learn.remote(kl_ctl.value, *exps[i::len(actor)]) for i, w in enumerate(actor.workers)]
        cr = [w.learn.remote(*exps[i::len(critic)]) for i, w in enumerate(critic.workers)] if critic is not None else []
        a_stats, c_stats = ray.get(a), ray.get(cr)
        t_learn = time.perf_counter()
        # 6. KL controller, on the per-sequence KL of this rollout
        kl_coef = kl_ctl.value
        kl_ctl.update(stats["kl"], cfg.rollout_batch_size)
        # 7. metrics
        learn = {k: sum(s[k] for s in a_stats) / len(a_stats) for k in a_stats[0]}
        if c_stats:
            learn.update({k: sum(s[k] for s in c_stats) / len(c_stats) for k in c_stats[0]})
        m = {"iteration": it, **{f"ppo/{k}": v for k, v in {**stats, **learn}.items()}, "ppo/kl_coef": kl_coef,
             "time/generate_s": t_gen - t0, "time/score_s": t_score - t_gen, "time/learn_s": t_learn - t_score,
             "time/iteration_s": t_learn - t0,
             "time/learn_tokens_per_s": stats["tokens"] * cfg.ppo_epochs / (t_learn - t_score)}  # each learner's real tokens
        log.info("ppo %d/%d reward %.3f±%.3f kl %.3f entropy %.2f policy_loss %.4f value_loss %s clip %.3f len %.1f "
                 "| gen %.2fs score %.2fs learn %.2fs", it, cfg.num_iterations, m["ppo/reward_mean"], m["ppo/reward_std"],
                 m["ppo/kl"], m["ppo/entropy"], m["ppo/policy_loss"], f"{m['ppo/value_loss']:.4f}" if "ppo/value_loss" in m else "-",
                 m["ppo/clip_fraction"], m["ppo/response_length"], *(m[f"time/{p}_s"] for p in ("generate", "score", "learn")))
        return m

    def evaluate(self, it: int) -> dict:
        """On prompts_eval, sampling from a fixed seed (or greedy): the reward model's mean score
        (``eval/rm_score``, when a term is the model), the reward's (``eval/reward``, the weighted sum
        of ``ppo.rewards`` unless that is the model alone), the KL to the initial policy (summed k1
        per response) and, for the built-in task, the ground-truth score."""
        import ray

        t0 = time.perf_counter()
        actor = self.g["actor"]
        n = len(actor)
        parts = [self.evals[i::n] for i in range(n)]
        recs = None if self.eval_records is None else [self.eval_records[i::n] for i in range(n)]
        rollouts = [w.generate.remote(p, 1, self.cfg.eval_greedy, EVAL_SEED) for w, p in zip(actor.workers, parts)]
        policy, ref, terms = self._score(rollouts, recs)
        rollouts, policy, ref = ray.get(rollouts), ray.get(policy), ray.get(ref)
        term_scores = [torch.cat(ray.get(t)).float() for t in terms]
        reward = sum(src.weight * s for src, s in zip(self.cfg.rewards, term_scores))
        rm = next((s for src, s in zip(self.cfg.rewards, term_scores) if src.kind == "model"), None)
        mask = torch.cat([r.action_mask for r in rollouts])
        kl = torch.cat([((lp - rl) * r.action_mask).sum(1) for r, (lp, _), rl in zip(rollouts, policy, ref)])
        m = {"iteration": it, **({"eval/rm_score": float(rm.mean())} if rm is not None else {}),
             **({"eval/reward": float(reward.mean())} if not self.rm_only else {}),
             "eval/kl": float(kl.mean()), "eval/response_length": float(mask.sum(1).mean())}
        texts = self.responses(rollouts)
        order = [p for part in parts for p in part]  # the prompts in the order of the responses
        m["eval/samples"] = [{"prompt": self.tok.decode(order[j], skip_special_tokens=True), "response": texts[j],
                              **({"rm_score": float(rm[j])} if rm is not None else {}),
                              **({"reward": float(reward[j])} if not self.rm_only else {}),
                              **({"true_score": score_response(texts[j])} if self.builtin else {})}
                             for j in range(min(SAMPLES, len(texts)))]
        if self.builtin:
            m["eval/true_score"] = sum(map(score_response, texts)) / len(texts)
            m["eval/sample"] = texts[0]
        m["time/eval_s"] = time.perf_counter() - t0
        log.info("ppo eval @%d: %s true_score %s kl %.3f | %r", it,
                 " ".join(f"{k.split('/')[1]} {m[k]:.3f}" for k in ("eval/rm_score", "eval/reward") if k in m),
                 f"{m['eval/true_score']:.3f}" if self.builtin else "-", m["eval/kl"], m.get("eval/sample", ""))
        return m

    def responses(self, rollouts) -> list[str]:
        out = []
        for r in rollouts:
            n = r.action_mask.shape[1]
            for seq, mask in zip(r.sequences[:, -n:], r.action_mask.bool()):
                out.append(self.tok.decode(seq[mask].tolist(), skip_special_tokens=True))
        return out


def _metadata(records: list[dict]) -> dict[str, list]:
    """The prompt records' metadata columns (``data.prompt_metadata``) as keyword lists, in row order."""
    cols = records[0].get("metadata", {}) if records else {}
    return {c: [r["metadata"][c] for r in records] for c in cols}
