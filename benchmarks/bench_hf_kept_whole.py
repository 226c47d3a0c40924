"""A Hugging Face model kept whole against the same model written as a layer list by hand.

Model: Llama from a config (hidden ``--hidden``, ``--blocks`` decoder blocks, 4 heads, 2
key/value heads, vocabulary 256, sequence ``--seq``), float32, AdamW, global batch 8 of
right-padded rows (attention_mask 0 on the last 1-3 positions of half the rows, labels
-100 on the last 4 positions of every row), one intra-op thread per rank. Both variants
train on the same 2-stage plan on two CPU processes (spawned, gloo), ``--micro-batches``
micro-batches, out-of-order backprop on (what ``ooo="auto"`` picks for a given 2-stage plan)
and no recomputation:

* ``kept-whole``: ``self.model = AutoModelForCausalLM.from_config(cfg)``, ``forward`` calls
  ``self.model(input_ids=..., attention_mask=..., labels=...)``, ``training_step`` returns
  ``.loss``; the layer list is found from ``forward`` (``profile/hf_layers.py``);
* ``hand-written``: ``self.layers = nn.Sequential(...)`` of the same model's submodules: the
  embedding, each decoder block in a wrapper that builds its causal mask
  (``masking_utils.create_causal_mask``) and rotary table, and the final norm with the head
  and Hugging Face's causal-LM loss. Its loss equals the kept-whole model's (checked here in
  one process before timing).

Two measurements (``--part``):

* ``runner`` (the default, the tight one): on two spawned gloo ranks, each rank builds both
  variants' layer lists (the kept-whole one found from ``forward`` by the strategy's
  ``find_layers``, the hand-written ``self.layers``) with a ``StageRunner`` of the same plan
  each and AdamW, and times them in alternating blocks of ``--block`` steps (a barrier
  before and after each block, the start alternating each round): the layer lists' cost
  alone, neighbouring blocks seeing the same load on the shared cores. Result: the median
  of the blocks' time per step per variant and the median of the per-round ratios
  kept-whole / hand-written (with its quartiles).
* ``trainer``: whole ``Trainer`` fits. A Callback records ``on_train_batch_start`` ->
  ``on_train_batch_end`` on every rank; a fit's step time is rank 0's median after
  ``--warmup`` steps. Each round fits both variants for ``--steps`` steps, the order
  alternating between rounds; the result is the median step time per variant and the
  median of the per-round ratios. Fits are tens of seconds apart, so the other jobs on the
  shared cores move the per-round ratios far more than the runner part's.

    python benchmarks/bench_hf_kept_whole.py                      # runner part -> results/hf_kept_whole.json
    python benchmarks/bench_hf_kept_whole.py --part trainer       # Trainer fits, same file (its own key)
    python benchmarks/bench_hf_kept_whole.py --part trainer --rounds 3 --steps 12 --warmup 4   # quick look
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

HERE = Path(__file__).resolve().parent
VARIANTS = ("kept-whole", "hand-written")
VOCAB = 256


def _config(cfg: dict) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=cfg["hidden"], intermediate_size=4 * cfg["hidden"], num_hidden_layers=cfg["blocks"],
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(128, cfg["seq"]), tie_word_embeddings=False,
    )


def _hf_model(cfg: dict) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(_config(cfg))


class KeptWhole(LightningModule):
    """The model as people write it: the Hugging Face model kept whole and called by keyword."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.model = _hf_model(cfg)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def training_step(self, batch, i):
        return self(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Embed(nn.Module):
    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, x):
        input_ids, attention_mask, labels = x
        return self.embed_tokens(input_ids), attention_mask, labels


class Block(nn.Module):
    """One decoder block with the causal mask and rotary table it needs, built here."""

    def __init__(self, block: nn.Module, rotary: nn.Module, config: Any) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary
        self.config = config

    def forward(self, x):
        from transformers.masking_utils import create_causal_mask

        hidden, attention_mask, labels = x
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask, cache=None, position_ids=position_ids)
        rotary = self.rotary(hidden, position_ids=position_ids)
        hidden = self.block(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids, use_cache=False)
        return hidden, attention_mask, labels


class Head(nn.Module):
    """Final norm, the LM head and Hugging Face's causal-LM loss (shifted, -100 ignored)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, vocab_size: int) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.vocab_size = vocab_size

    def forward(self, x):
        from transformers.loss.loss_utils import ForCausalLMLoss

        hidden, _, labels = x
        return ForCausalLMLoss(self.lm_head(self.norm(hidden)), labels, self.vocab_size)


class HandWritten(LightningModule):
    """The same model's submodules as a layer list written by hand."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        model = _hf_model(cfg)
        base = model.model
        self.layers = nn.Sequential(
            Embed(base.embed_tokens),
            *(Block(block, base.rotary_emb, base.config) for block in base.layers),
            Head(base.norm, model.lm_head, model.config.vocab_size),
        )

    def forward(self, input_ids, attention_mask=None, labels=None):
        x = (input_ids, attention_mask, labels)
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch, i):
        return self(**batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _batches(cfg: dict, count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    rows, seq = cfg["batch"], cfg["seq"]
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (rows, seq), generator=generator)
        mask = torch.ones(rows, seq, dtype=torch.long)
        for row in range(1, rows, 2):
            mask[row, seq - 1 - row % 3:] = 0
        labels = ids.clone()
        labels[:, -4:] = -100  # the same count of ignored labels in every row (HF's token mean is a row mean)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


class StepTimer(Callback):
    """Per rank: perf_counter at every on_train_batch_start/end, written to
    ``<directory>/times_rank<r>.json`` at the end of the fit."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.spans: list[tuple[float, float]] = []
        self._start = 0.0

    def setup(self, trainer, pl_module, stage) -> None:
        torch.set_num_threads(1)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.spans.append((self._start, time.perf_counter()))

    def on_train_end(self, trainer, pl_module) -> None:
        with open(f"{self.directory}/times_rank{trainer.global_rank}.json", "w") as stream:
            json.dump(self.spans, stream)


def _plan(cfg: dict) -> dict:
    layers = cfg["blocks"] + 2
    cut = 1 + cfg["blocks"] // 2
    return {
        "global_batch_size": cfg["batch"], "micro_batches": cfg["micro_batches"],
        "stages": [{"layers": [0, cut], "devices": [0]}, {"layers": [cut, layers], "devices": [1]}],
    }


def _fit(name: str, cfg: dict, directory: str) -> float:
    """Rank 0's median step time (ms) of one fit of ``name`` after the warm-up steps."""
    from lightning_dapple.strategy import DappleStrategy

    model = KeptWhole(cfg) if name == "kept-whole" else HandWritten(cfg)
    Path(directory).mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        strategy=DappleStrategy(plan=_plan(cfg), timeout_s=120, start_method="spawn"), accelerator="cpu", devices=2, precision="32-true",
        max_steps=cfg["steps"], logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=directory, callbacks=[StepTimer(directory)],
    )
    trainer.fit(model, torch.utils.data.DataLoader(_batches(cfg, cfg["steps"]), batch_size=None))
    spans = json.loads(Path(directory, "times_rank0.json").read_text())[cfg["warmup"]:]
    return 1000 * statistics.median(end - start for start, end in spans)


def _check_same_loss(cfg: dict) -> float:
    """Both variants' loss on one batch, in one process (they must agree)."""
    batch = _batches(cfg, 1)[0]
    with torch.no_grad():
        kept = float(KeptWhole(cfg)(**batch).loss)
        hand = float(HandWritten(cfg)(**batch))
    assert abs(kept - hand) <= 1e-6 * abs(kept), (kept, hand)
    return kept


def _runner_rank(rank: int, world: int, cfg: dict) -> dict[str, list[float]]:
    """Both variants on this rank, timed in alternating blocks (module docstring)."""
    import torch.distributed as dist

    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.runner import StageRunner
    from lightning_dapple.plan.plan import plan_from_dict
    from lightning_dapple.strategy.module_adapter import find_layers

    torch.set_num_threads(1)
    plan = plan_from_dict({**_plan(cfg), "ooo": True})
    stage = plan.stages[rank]
    batches = [tuple(b[k] for k in ("input_ids", "attention_mask", "labels")) for b in _batches(cfg, 4)]
    samples = [tuple(a[:rows] for a in batches[0]) for rows in (1, 2)]

    class Callbacks:
        def __init__(self, kept: bool) -> None:
            self.kept = kept

        def make_input(self, batch: Any) -> Any:
            return batch

        def compute_loss(self, batch: Any, forward: Any) -> Any:
            out = forward(batch)
            return out.loss if self.kept else out

    variants = []
    for name in VARIANTS:
        module = KeptWhole(cfg) if name == "kept-whole" else HandWritten(cfg)
        layers = list(find_layers(module, "layers", lambda: samples)) if name == "kept-whole" else list(module.layers)
        assert len(layers) == cfg["blocks"] + 2
        runner = StageRunner.for_plan(plan, rank, layers[stage.start:stage.end], torch.device("cpu"), FailureChannel(rank, timeout_s=300), ties=())
        optimizer = torch.optim.AdamW(runner.parameters, lr=1e-3)
        callbacks = Callbacks(name == "kept-whole")

        def step(batch: Any, runner=runner, optimizer=optimizer, callbacks=callbacks) -> None:
            runner.train_step(batch, callbacks)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for index in range(cfg["warmup"]):
            step(batches[index % len(batches)])
        variants.append((name, runner, step))
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for round_ in range(cfg["rounds"]):
        for name, _, step in variants if round_ % 2 == 0 else variants[::-1]:
            dist.barrier()
            start = time.perf_counter()
            for index in range(cfg["block"]):
                step(batches[index % len(batches)])
            dist.barrier()
            times[name].append(1000 * (time.perf_counter() - start) / cfg["block"])
    for _, runner, _ in variants:
        runner.finish()
    return times


def _quartiles(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4)
    return [round(q[0], 4), round(q[2], 4)]


def _runner_part(cfg: dict) -> dict:
    from lightning_dapple.execute.launch import run_ranks

    started = time.time()
    times = run_ranks(_runner_rank, 2, cfg, timeout_s=1800, raise_on_error=True)[0]  # rank 0; the barriers line the ranks up
    ratios = [k / h for k, h in zip(times["kept-whole"], times["hand-written"])]
    for round_ in range(0, len(ratios), max(1, len(ratios) // 8)):
        print(f"round {round_}: kept-whole {times['kept-whole'][round_]:.2f} ms, hand-written {times['hand-written'][round_]:.2f} ms; ratio {ratios[round_]:.3f}")
    return {
        "step_ms": {name: {"median": round(statistics.median(v), 3), "quartiles": _quartiles(v)} for name, v in times.items()},
        "ratio_kept_whole_to_hand_written": {"median": round(statistics.median(ratios), 4), "quartiles": _quartiles(ratios), "rounds": len(ratios)},
        "wall_s": round(time.time() - started, 1),
    }


def _trainer_part(cfg: dict) -> dict:
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    ratios: list[float] = []
    started = time.time()
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(cfg["rounds"]):
            order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
            measured = {name: _fit(name, cfg, f"{scratch}/r{round_}-{name}") for name in order}
            for name in VARIANTS:
                times[name].append(measured[name])
            ratios.append(measured["kept-whole"] / measured["hand-written"])
            print(f"round {round_}: " + ", ".join(f"{n} {measured[n]:.2f} ms" for n in order) + f"; ratio {ratios[-1]:.3f}", flush=True)
    return {
        "step_ms_rank0": {name: {"median": round(statistics.median(v), 3), "rounds": [round(t, 3) for t in v]} for name, v in times.items()},
        "ratio_kept_whole_to_hand_written": {"median": round(statistics.median(ratios), 4), "min": round(min(ratios), 4),
                                             "max": round(max(ratios), 4), "rounds": [round(r, 4) for r in ratios]},
        "wall_s": round(time.time() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("runner", "trainer"), default="runner")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=None, help="default: 60 (runner), 8 (trainer)")
    parser.add_argument("--block", type=int, default=5, help="runner: steps per timed block")
    parser.add_argument("--steps", type=int, default=40, help="trainer: steps per fit")
    parser.add_argument("--warmup", type=int, default=10, help="steps before timing (runner), first steps of each fit left out (trainer)")
    parser.add_argument("--out", default=str(HERE / "results" / "hf_kept_whole.json"))
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 60 if args.part == "runner" else 8
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import transformers

    cfg = {k: getattr(args, k) for k in ("hidden", "blocks", "seq", "batch", "micro_batches", "rounds", "block", "steps", "warmup")}
    loss = _check_same_loss(cfg)
    print(f"first-batch loss, both variants: {loss:.6f}")
    measured = _runner_part(cfg) if args.part == "runner" else _trainer_part(cfg)
    keys = ("rounds", "block", "warmup") if args.part == "runner" else ("rounds", "steps", "warmup")
    result = {
        "command": f"python benchmarks/bench_hf_kept_whole.py --part {args.part} " + " ".join(f"--{k} {cfg[k]}" for k in keys),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        **measured,
    }
    print(json.dumps(result, indent=2))
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.is_file() else {}
    data["config"] = {
        "model": "LlamaForCausalLM", **{k: cfg[k] for k in ("hidden", "blocks", "seq", "batch", "micro_batches")}, "heads": 4, "kv_heads": 2,
        "vocab": VOCAB, "dtype": "float32", "plan": _plan(cfg), "ooo": True, "threads_per_rank": 1, "machine": "2 shared CPU cores",
        "transformers": transformers.__version__, "torch": torch.__version__,
    }
    data[args.part] = result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")

if __name__ == "__main__":
    main()
