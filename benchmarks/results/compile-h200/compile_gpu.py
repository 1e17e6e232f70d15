"""Compiled against eager on one GPU: the GPT under 1f1b (one stage) and zero-bubble-v (a V of two)."""
import json, os, socket, statistics, sys, time, warnings
T0 = time.time()
import torch
warnings.simplefilter("ignore")
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
from gpipe import Pipeline
from gpipe.models.gpt import GPTConfig, build_gpt, lm_loss
OUT = os.environ.get("OUT", "/tmp")
report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "phases": {}}
def dump():
    json.dump(report, open(f"{OUT}/compile_gpu.json", "w"), indent=1)
cfg = GPTConfig(n_layer=8, d_model=1024, n_head=16, vocab_size=8192, seq_len=512, dropout=0.0)
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, cfg.vocab_size, (16, 513), generator=g).cuda()
x, y = ids[:, :-1], ids[:, 1:]
pipes = {}
for schedule, balance in (("1f1b", [10]), ("zero-bubble-v", [5, 5])):
    for compiled in (False, True):
        torch.manual_seed(0)
        pipes[f"{schedule}/{'compiled' if compiled else 'eager'}"] = Pipeline(
            build_gpt(cfg).cuda(), balance, chunks=8, checkpoint="never", schedule=schedule,
            loss_fn=lm_loss, device="cuda", compile=compiled)
first = {}
for name, pipe in pipes.items():
    torch.cuda.synchronize(); t = time.time()
    loss = float(pipe.step(x, y)); pipe.step(x, y); torch.cuda.synchronize()
    first[name] = {"seconds": time.time() - t, "first_loss": loss}
    print(name, first[name], flush=True)
report["phases"]["first_two_steps"] = first; dump()
times = {n: [] for n in pipes}
names = list(pipes)
cycle = 0
while cycle < 11 and time.time() - T0 < float(sys.argv[1]):
    for n in names[cycle % 4:] + names[:cycle % 4]:
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(3): pipes[n].step(x, y)
        torch.cuda.synchronize(); times[n].append((time.perf_counter() - t) / 3)
    cycle += 1
report["phases"]["cycles"] = cycle
report["phases"]["seconds"] = times
ratios = {}
for s in ("1f1b", "zero-bubble-v"):
    ratios[s] = statistics.median(c / e for c, e in zip(times[f"{s}/compiled"], times[f"{s}/eager"]))
report["phases"]["compiled_over_eager"] = ratios
report["phases"]["median_ms"] = {n: 1e3 * statistics.median(v) for n, v in times.items()}
dump()
print(json.dumps({k: report["phases"][k] for k in ("cycles", "compiled_over_eager", "median_ms")}), flush=True)
