"""ColossalAI 0.5.0's plugins on CPU (gloo), 2 processes, a tiny LoRA Llama, 3 steps through
``booster.backward`` (issue 19). Needs an environment with the ColossalAI closure
(`scripts/setup.sh --colossalai`); CI has none, so this is a script, with its output recorded in
bench/results/colossalai_cpu_plugins.txt:

    .venv/bin/python -W ignore bench/colossalai_cpu_plugins.py ddp adam     # TorchDDPPlugin + torch Adam
    .venv/bin/python -W ignore bench/colossalai_cpu_plugins.py zero2 adam   # LowLevelZeroPlugin(stage=2)
    .venv/bin/python -W ignore bench/colossalai_cpu_plugins.py ddp hybrid   # HybridAdam
    .venv/bin/python -W ignore bench/colossalai_cpu_plugins.py gemini hybrid
A failing rank prints its exception's last line.
"""
import os
import sys
import traceback

import torch
import torch.multiprocessing as mp

def body(rank, world, port, plugin_name, optim_name):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import colossalai
    from colossalai.booster import Booster
    from colossalai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
    from colossalai.nn.optimizer import HybridAdam
    from transformers import LlamaConfig, LlamaForCausalLM
    from peft import LoraConfig, get_peft_model
    colossalai.launch_from_torch(backend="gloo", seed=0)
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4))
    m = get_peft_model(m, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    plugin = {"ddp": lambda: TorchDDPPlugin(),
              "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
              "zero2_offload": lambda: LowLevelZeroPlugin(stage=2, precision="fp32", cpu_offload=True),
              "gemini": lambda: GeminiPlugin(precision="fp16", initial_scale=2**5, offload_optim_frac=1.0, offload_param_frac=1.0)}[plugin_name]()
    params = [p for p in m.parameters() if p.requires_grad]
    optim = HybridAdam(params, lr=1e-2) if optim_name == "hybrid" else torch.optim.Adam(params, lr=1e-2)
    booster = Booster(plugin=plugin)
    model, optim, *_ = booster.boost(m, optim)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    before = {n: p.detach().clone() for n, p in model.unwrap().named_parameters() if p.requires_grad}
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, optim)
        optim.step(); optim.zero_grad()
    moved = sum(int(not torch.equal(before[n], p.detach())) for n, p in model.unwrap().named_parameters() if p.requires_grad)
    print(f"rank {rank} {plugin_name}/{optim_name}: loss {loss.item():.4f}, {moved}/{len(before)} LoRA tensors moved", flush=True)

def run(rank, world, port, plugin_name, optim_name):
    try:
        body(rank, world, port, plugin_name, optim_name)
    except Exception:
        where = traceback.extract_tb(sys.exc_info()[2])[-1]
        print(f"rank {rank} {plugin_name}/{optim_name}: FAILED at {where.filename.split('site-packages/')[-1]}:{where.lineno}: "
              f"{traceback.format_exc().strip().splitlines()[-1]}", flush=True)
        sys.exit(1)

if __name__ == "__main__":
    plugin_name, optim_name = sys.argv[1], sys.argv[2]
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(run, args=(2, port, plugin_name, optim_name), nprocs=2)
