"""training_steps as people write them, where a pipeline could silently compute something else.

* A language-model loss: ``cross_entropy`` over tokens, padding labelled -100. Its mean is
  over the targets that are not ignored, not over samples, so weighting each micro-batch's
  loss by its rows gives other gradients than one device. The first training step finds it
  and stops before any parameter changes (``strategy/loss_check.py``);
  ``loss_reduction="micro_batch_mean"`` opts into the row-weighted micro-batch means.
* A step that calls ``self(...)`` twice (two views of the batch): under a pipeline the layers
  run once per micro-batch, so a second call is refused (``execute/stage.py``); where the
  whole model runs in one process with its stash kept, the second call runs the layers again
  and trains like plain Lightning.

One device in this process, M = 2: the micro-batch split and the last stage's step are the
pipeline's own.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader

import lightning_dapple  # noqa: F401
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy.loss_check import LossWatch, uneven_mean
from lightning_toys import states_under_plan_and_plain

VOCAB, LENGTH, ROWS = 11, 6, 4
ONE_STAGE = {"global_batch_size": ROWS, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}]}


class TinyLM(LightningModule):
    """Embedding and head; the loss is Hugging Face's: mean token cross-entropy, -100 ignored."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layers = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](tokens))

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class TwoViews(TinyLM):
    """A consistency term between the batch and its reversed copy: two self(...) calls."""

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        a, b = self(tokens), self(tokens.flip(-1))
        return F.cross_entropy(a.reshape(-1, VOCAB), labels.reshape(-1)) + F.mse_loss(a.softmax(-1), b.softmax(-1))


def _loader(padded: bool) -> DataLoader:
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
        labels = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
        if padded:  # rows of different lengths: the first micro-batch has more padding
            labels[0, 2:] = -100
            labels[1, 4:] = -100
        batches.append((tokens, labels))
    return DataLoader(batches, batch_size=None)


def _fit(tmp_path: Path, model: LightningModule, padded: bool, strategy: DappleStrategy | str = "auto") -> Trainer:
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=1, precision="64-true", max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    trainer.fit(model, _loader(padded))
    return trainer


def _dapple(**kwargs) -> DappleStrategy:
    return DappleStrategy(plan=kwargs.pop("plan", ONE_STAGE), timeout_s=20, **kwargs)


def test_a_mean_over_unignored_tokens_is_refused_before_any_parameter_changes(tmp_path: Path) -> None:
    model = TinyLM()
    before = {k: v.clone() for k, v in model.double().state_dict().items()}
    with pytest.raises(DappleConfigError, match=r"cross_entropy averages over the targets other than ignore_index=-100.*Fix: return a mean over samples.*loss_reduction='micro_batch_mean'"):
        _fit(tmp_path, model, padded=True, strategy=_dapple())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_without_ignored_targets_or_with_the_opt_in_it_trains(tmp_path: Path) -> None:
    """No padding: a mean over samples, single-device gradients. Padding with
    ``micro_batch_mean``: each micro-batch's token mean weighted by its rows, as asked."""
    plain, ours = TinyLM().double(), TinyLM().double()
    _fit(tmp_path / "plain", plain, padded=False)
    _fit(tmp_path / "ours", ours, padded=False, strategy=_dapple())
    assert max(float((ours.state_dict()[k] - v).abs().max()) for k, v in plain.state_dict().items()) < 1e-12
    opted, reference = TinyLM().double(), TinyLM().double()
    _fit(tmp_path / "opted", opted, padded=True, strategy=_dapple(loss_reduction="micro_batch_mean"))
    _fit(tmp_path / "reference", reference, padded=True)
    assert max(float((opted.state_dict()[k] - v).abs().max()) for k, v in reference.state_dict().items()) > 1e-6  # not one device's


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"target": torch.tensor([1, 2]), "weight": torch.ones(3)}, r"weight=\.\.\.\) divides by the summed class weights"),
        ({"target": torch.tensor([1, 7]), "ignore_index": 7}, "other than ignore_index=7 \\(1 of 2"),
        ({"target": torch.tensor([1, -100]), "reduction": "sum"}, None),
        ({"target": torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]])}, None),  # class probabilities
        ({"target": torch.tensor([1, 2])}, None),
    ],
)
def test_which_losses_are_means_over_targets(kwargs: dict, reason: str | None) -> None:
    found = uneven_mean(F.cross_entropy, (torch.randn(2, 3),), kwargs)
    assert (found is None) if reason is None else (found is not None and re.search(reason, found) is not None), found
    logits = torch.randn(2, 3, requires_grad=True)
    watch = LossWatch()
    with watch.watching(2):
        loss = torch.nn.NLLLoss(ignore_index=-100)(logits.log_softmax(-1), torch.tensor([0, -100]))
    assert len(watch.found) == 1 and watch.found[0][0].startswith("nll_loss averages")
    with pytest.raises(DappleConfigError, match="nll_loss averages"):
        watch.check(loss)


def test_an_ignored_target_in_every_row_alike_or_a_loss_only_logged_is_not_refused() -> None:
    """A causal LM's shifted labels keep one -100 per row: every micro-batch's count is
    proportional to its rows. A masked perplexity computed for a log feeds no loss."""
    logits = torch.randn(4, 5, 3, requires_grad=True)
    shifted = torch.randint(0, 3, (4, 5))
    shifted[:, -1] = -100
    watch = LossWatch()
    for rows in ((0, 2), (2, 4)):  # the step's two micro-batches
        with watch.watching(2):
            loss = F.cross_entropy(logits[slice(*rows)].reshape(-1, 3), shifted[slice(*rows)].reshape(-1))
        watch.check(loss)
    padded = shifted.clone()
    padded[0, 1:] = -100
    with watch.watching(4):
        logged = F.cross_entropy(logits.reshape(-1, 3), padded.reshape(-1))
        loss = F.mse_loss(logits, torch.zeros_like(logits))
    watch.check(loss)  # the padded one is not in the loss
    with watch.watching(4):
        loss = F.cross_entropy(logits.reshape(-1, 3), padded.reshape(-1)) + 0 * logged
    with pytest.raises(DappleConfigError, match="differs between rows"):
        watch.check(loss)


def _token_losses(rows: int, padded: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits (rows, 5, 3) that need gradients, their labels, and a padding mask (1: a real
    token): rows of 5, 3, 5, ... tokens when ``padded``, else all 5."""
    logits = torch.randn(rows, 5, 3, requires_grad=True)
    labels = torch.randint(0, 3, (rows, 5))
    mask = torch.ones(rows, 5)
    if padded:
        mask[1::2, 3:] = 0
    return logits, labels, mask


@pytest.mark.parametrize(
    ("loss_of", "refused"),
    [
        # Hugging Face-style token means written by hand: refused with padding
        (lambda tokens, labels, mask: (tokens * mask.reshape(-1)).sum() / mask.sum(), "divides by the sum of a mask"),
        (lambda tokens, labels, mask: (tokens * mask.reshape(-1)).sum() / mask.sum().clamp(min=1.0), "divides by the sum of a mask"),
        (lambda tokens, labels, mask: tokens[mask.reshape(-1).bool()].mean(), "averages what a boolean mask selects"),
        # per-sample means: each row's token mean, then the rows
        (lambda tokens, labels, mask: ((tokens.reshape(mask.shape) * mask).sum(1) / mask.sum(1)).mean(), None),
    ],
)
def test_token_means_written_by_hand_are_refused_where_rows_hold_other_counts(loss_of, refused: str | None) -> None:
    for padded in (True, False):
        logits, labels, mask = _token_losses(4, padded)
        watch = LossWatch()
        for rows in ((0, 2), (2, 4)):  # the step's two micro-batches
            with watch.watching(2):
                tokens = F.cross_entropy(logits[slice(*rows)].reshape(-1, 3), labels[slice(*rows)].reshape(-1), reduction="none")
                loss = loss_of(tokens, labels[slice(*rows)], mask[slice(*rows)])
            if refused is None or not padded:  # no padding: every row's count alike, a mean over samples
                watch.check(loss)
                continue
            with pytest.raises(DappleConfigError, match=f"{refused} \\(a token mean\\), whose count of targets differs between rows"):
                watch.check(loss)
            break


def test_cross_entropy_over_what_a_boolean_mask_selected_is_refused_with_padding() -> None:
    logits, labels, mask = _token_losses(2, padded=True)
    watch = LossWatch()
    with watch.watching(2):
        keep = mask.bool()
        loss = F.cross_entropy(logits[keep], labels[keep])
    with pytest.raises(DappleConfigError, match="cross_entropy averages over the targets a boolean mask selected"):
        watch.check(loss)


def test_a_second_self_call_runs_again_on_one_stage_and_is_refused_where_the_input_arrived(tmp_path: Path) -> None:
    plain, ours = TwoViews().double(), TwoViews().double()
    _fit(tmp_path / "plain", plain, padded=False)
    _fit(tmp_path / "ours", ours, padded=False, strategy=_dapple())  # whole model, stash kept: both calls run
    assert max(float((ours.state_dict()[k] - v).abs().max()) for k, v in plain.state_dict().items()) < 1e-12
    recomputed = {**ONE_STAGE, "stages": [{"layers": [0, 2], "devices": [0], "recompute": "always"}]}
    with pytest.raises(DappleConfigError, match=r"calls self\(\.\.\.\) more than once on a stage that recomputes its forward.*Fix: call self\(\.\.\.\) once per step"):
        _fit(tmp_path / "recomputed", TwoViews().double(), padded=False, strategy=_dapple(plan=recomputed))


def test_where_the_input_arrived_a_repeat_call_with_that_input_runs_again_and_another_input_is_refused() -> None:
    from lightning_dapple.execute.stage import guard_calls

    calls = []
    x, y = torch.ones(2, 3), torch.zeros(2, 3)
    guarded = guard_calls(lambda *args: calls.append(args) or len(calls), recomputed=False)
    assert guarded(x) == 1 and guarded(x) == 2 and guarded(x.clone()) == 3  # a loss, then a metric from self(x)
    with pytest.raises(DappleConfigError, match=r"calls self\(\.\.\.\) again with another input.*Fix: put the views in one batch"):
        guarded(y)
    once = guard_calls(lambda *args: 0, recomputed=True)
    once(x)
    with pytest.raises(DappleConfigError, match="recomputes its forward"):
        once(x)


def _fit_two_stages(tmp_path: Path, model: LightningModule, cut: int) -> None:
    """One step of ``model`` (5 inputs, 4 rows) on two stages cut before layer ``cut``."""
    data = [(torch.randn(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.long))]
    layers = len(model.layers)
    plan = {"global_batch_size": 4, "micro_batches": 2, "stages": [{"layers": [0, cut], "devices": [0]}, {"layers": [cut, layers], "devices": [1]}]}
    Trainer(
        strategy=DappleStrategy(plan=plan, timeout_s=60, start_method="spawn"), accelerator="cpu", devices=2, precision="64-true",
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
    ).fit(model, DataLoader(data, batch_size=None))


class RDrop(LightningModule):
    """R-Drop: two self(x) calls and a symmetric KL between their dropout samples; the
    dropout sits in the layers the plan puts on the first stage."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.layers = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        a, b = self(x), self(x)
        kl = F.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="batchmean")
        return F.cross_entropy(a, y) + F.cross_entropy(b, y) + kl

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_which_layers_draw_dropout() -> None:
    from lightning_dapple.execute.random_layers import draws_random

    assert draws_random([nn.Linear(2, 2), nn.Sequential(nn.Dropout(0.1))])
    assert draws_random([nn.MultiheadAttention(4, 2, dropout=0.1)])
    assert draws_random([nn.TransformerEncoderLayer(4, 2, dim_feedforward=8)])
    assert not draws_random([nn.Linear(2, 2), nn.Dropout(0.0), nn.MultiheadAttention(4, 2)])


@pytest.mark.timeout(300)
def test_a_second_call_sharing_the_first_stages_dropout_is_refused(tmp_path: Path) -> None:
    """On one device the two calls draw two dropout samples; on a pipeline the first stage
    ran once, so they would share its draws and the KL term would lose them."""
    with pytest.raises(Exception, match=r"rank 1: .*calls self\(\.\.\.\) again on the same input, expecting new dropout draws.*"
                       r"Fix: put both samples in one batch"):
        _fit_two_stages(tmp_path, RDrop().double(), cut=3)


class SchedulerInStep(TinyLM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.lr_schedulers().step()
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)}


def test_a_scheduler_stepped_inside_the_step_is_refused_before_the_optimizer_steps(tmp_path: Path) -> None:
    """The step runs once per micro-batch (and past self(...) on the last stage only): a
    scheduler stepped there would move the rate M times, on some ranks."""
    model = SchedulerInStep().double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DappleConfigError, match=r"training_step: changes a learning rate.*Fix: step the scheduler from configure_optimizers"):
        _fit(tmp_path, model, padded=False, strategy=_dapple())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_step_returning_none_to_skip_its_batch_is_told_how_to_skip_it() -> None:
    from lightning_dapple.strategy.module_adapter import loss_of

    with pytest.raises(DappleConfigError, match=r"training_step: returned None, which asks Lightning to skip the batch.*Fix: leave such batches out"):
        loss_of(None)
    with pytest.raises(DappleConfigError, match=r"training_step: returned str.*Fix: return the loss tensor"):
        loss_of("loss")


def test_two_calls_on_one_stage_draw_two_dropout_samples() -> None:
    """R-Drop, SimCSE: two self(x) calls on the whole model must not share a dropout mask."""
    from lightning_dapple.execute.stage import Stage

    class TwoSamples:
        def compute_loss(self, batch, forward):
            a, b = forward(batch), forward(batch)
            self.differ = not torch.equal(a, b)
            return (a - b).pow(2).mean()

    callbacks = TwoSamples()
    stage = Stage([nn.Dropout(0.5)], torch.device("cpu"), index=0, replica=0, num_stages=1)
    stage.begin_step(torch.ones(4, 8), 4, [(0, 4)], callbacks, 1.0, (7, 0))
    stage.forward(0)
    assert callbacks.differ


# --------------------------------------------------------------------------- randomness in the step


class Denoiser(LightningModule):
    """Learns the noise its step adds to the input: the loss must see the draws the input got."""

    def __init__(self, out: str) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.layers = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Dropout(0.5), nn.Linear(6, 6))
        self.out = out
        self.drawn: list[list[float]] = []
        self.val_drawn: list[list[float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x = batch[0]
        noise = torch.randn_like(x)
        self.drawn.append(noise.sum(1).tolist())  # per row: on the first stage and on the last
        return F.mse_loss(self(x + noise), noise)

    def validation_step(self, batch, batch_idx):
        """A diffusion model's validation loss: noise drawn in the step, before self(...)."""
        x = batch[0]
        noise = torch.randn_like(x)
        self.val_drawn.append(noise.sum(1).tolist())
        predicted = self(x + noise)
        shown = torch.randint(0, len(x), ())  # a row to show: drawn after self(...), on the last stage only
        self.log("val_loss", F.mse_loss(predicted, noise))
        self.log("val_shown_row", predicted[shown].abs().mean())

    def on_train_end(self) -> None:
        Path(self.out, f"drawn{self.global_rank}.json").write_text(__import__("json").dumps([self.drawn, self.val_drawn]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(300)
def test_noise_drawn_in_the_step_is_the_same_on_the_first_stage_and_the_last(tmp_path: Path) -> None:
    """The first stage runs the step up to self(...) to make the input, the last runs it
    again for the loss: each slice's step runs under one seed of its rows on both, in
    training and in validation."""
    import json

    data = DataLoader([(torch.randn(4, 6, generator=torch.Generator().manual_seed(s)),) for s in range(3)], batch_size=None)
    val = DataLoader([(torch.randn(4, 6, generator=torch.Generator().manual_seed(s)),) for s in (7, 8)], batch_size=None)
    plan = {"global_batch_size": 4, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 4], "devices": [1]}]}
    trainer = Trainer(
        strategy=DappleStrategy(plan=plan, timeout_s=60, start_method="spawn"), accelerator="cpu", devices=2, max_steps=3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    trainer.fit(Denoiser(str(tmp_path)), data, val)
    (first, first_val), (last, last_val) = (json.loads((tmp_path / f"drawn{rank}.json").read_text()) for rank in (0, 1))
    assert len(first) == len(last) == 2 + 3 * 2  # set-up's calls to find the input (of 2 rows and of 1), then one per micro-batch and step
    first, last = first[2:], last[2:]
    assert first == last
    assert len({tuple(rows) for rows in first}) == 6  # other draws for every slice and step
    assert len(first_val) == len(last_val) == 2 * 2 * 2  # the sanity check's 2 batches, then the epoch's 2; 2 slices each
    assert first_val == last_val
    assert len({tuple(rows) for rows in first_val}) == 8  # each eval batch draws anew


def test_a_step_drawing_before_self_is_refused_where_the_last_stage_holds_other_rows() -> None:
    from lightning_dapple.execute.stage import Stage

    class Draws:
        def make_input(self, batch):
            return batch + torch.randn_like(batch)

    stage = Stage([nn.Linear(3, 3)], torch.device("cpu"), index=0, replica=0, num_stages=2, rows_as_last=False)
    stage.begin_step(torch.zeros(4, 3), 4, [(0, 2), (2, 4)], Draws(), 1.0, (7, 0))
    with pytest.raises(DappleConfigError, match=r"draws random numbers before self\(\.\.\.\).*different replica counts"):
        stage.forward(0)
    aligned = Stage([nn.Linear(3, 3)], torch.device("cpu"), index=0, replica=0, num_stages=2, rows_as_last=True)
    aligned.begin_step(torch.zeros(4, 3), 4, [(0, 2), (2, 4)], Draws(), 1.0, (7, 0))
    aligned.forward(0)  # the last stage draws the same: nothing to refuse


# --------------------------------------------------------------------------- a short last validation batch


class Classifier(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.layers = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(300)
def test_a_validation_set_whose_last_batch_is_short_validates_like_plain_lightning(tmp_path: Path) -> None:
    """17 samples in batches of 8 with M = 2 on 2 stages: the last batch of 1 row runs as
    one micro-batch (a forward-only pass needs no M), the metric is plain Lightning's."""
    g = torch.Generator().manual_seed(8)
    train = [(torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)) for _ in range(2)]
    val = torch.utils.data.TensorDataset(torch.randn(17, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (17,), generator=g))

    def fit(strategy, devices: int) -> float:
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=devices, precision="64-true", max_epochs=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        )
        trainer.fit(Classifier(), DataLoader(train, batch_size=None), DataLoader(val, batch_size=8))
        return float(trainer.callback_metrics["val_loss"])

    plan = {"global_batch_size": 8, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 3], "devices": [1]}]}
    ours = fit(DappleStrategy(plan=plan, timeout_s=60, start_method="spawn"), 2)
    assert ours == pytest.approx(fit("auto", 1), abs=1e-12)


# --------------------------------------------------------------------------- torchmetrics objects


class Summarized(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(2, 5, dtype=torch.float64)


@pytest.mark.timeout(300)
def test_a_model_with_an_example_input_trains_under_the_default_model_summary(tmp_path: Path) -> None:
    """ModelSummary runs forward on example_input_array on every rank, where a pipeline rank
    holds one stage: the strategy puts the example aside while the Trainer runs."""
    g = torch.Generator().manual_seed(19)
    data = [(torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g)) for _ in range(2)]

    plan = {"global_batch_size": 4, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 3], "devices": [1]}]}
    ours, plain = states_under_plan_and_plain(tmp_path, Summarized, data, plan, max_steps=2, enable_model_summary=True)
    assert max(float((ours[k] - v).abs().max()) for k, v in plain.items()) < 1e-12


@pytest.mark.timeout(300)
def test_save_checkpoint_after_a_spawned_fit_writes_the_whole_trained_model(tmp_path: Path) -> None:
    """Under the spawn launcher the calling process set no pipeline up; it holds the whole
    trained model after fit, and trainer.save_checkpoint writes it, as under ddp_spawn."""
    data = [(torch.randn(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.long)) for _ in range(2)]
    plan = {"global_batch_size": 4, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 3], "devices": [1]}]}
    trainer = Trainer(
        strategy=DappleStrategy(plan=plan, timeout_s=60, start_method="spawn"), accelerator="cpu", devices=2, precision="64-true",
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    model = Classifier().double()
    trainer.fit(model, DataLoader(data, batch_size=None))
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    saved = torch.load(tmp_path / "after.ckpt", weights_only=False)["state_dict"]
    assert set(saved) == set(model.state_dict())
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert not torch.equal(saved["layers.0.weight"], Classifier().double().state_dict()["layers.0.weight"])  # trained


class Tested(Classifier):
    def test_step(self, batch, batch_idx):
        self.log("test_loss", F.cross_entropy(self(batch[0]), batch[1]))


@pytest.mark.timeout(300)
def test_a_test_loader_with_another_batch_size_than_training_tests_like_plain_lightning(tmp_path: Path) -> None:
    """trainer.test after fit on two stages: the test batches (6 rows, training's are 4) are
    cut into the plan's micro-batches; no optimizer step asks them to be the global batch."""
    g = torch.Generator().manual_seed(17)
    train = [(torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g)) for _ in range(2)]
    test = [(torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)) for _ in range(2)]

    def fit_and_test(strategy, devices: int) -> float:
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=devices, precision="64-true", max_steps=2, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        )
        model = Tested().double()
        trainer.fit(model, DataLoader(train, batch_size=None))
        return trainer.test(model, DataLoader(test, batch_size=None), verbose=False)[0]["test_loss"]

    plan = {"global_batch_size": 4, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 3], "devices": [1]}]}
    ours = fit_and_test(DappleStrategy(plan=plan, timeout_s=60, start_method="spawn"), 2)
    assert ours == pytest.approx(fit_and_test("auto", 1), abs=1e-12)


class Scored(Classifier):
    """Metrics as Lightning's docs log them: a Metric called in the step, one only updated,
    and a MetricCollection through log_dict; macro F1 is not a mean of batch values."""

    def __init__(self) -> None:
        super().__init__()
        from torchmetrics import MetricCollection
        from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassPrecision

        self.train_f1 = MulticlassF1Score(num_classes=3, average="macro")
        self.val_f1 = MulticlassF1Score(num_classes=3, average="macro")
        self.val_acc = MulticlassAccuracy(num_classes=3, average="macro")
        self.val_set = MetricCollection({"precision": MulticlassPrecision(num_classes=3, average="macro")}, prefix="val_")

    def training_step(self, batch, batch_idx):
        logits = self(batch[0])
        self.train_f1(logits, batch[1])
        self.log("train_f1", self.train_f1, on_step=False, on_epoch=True)
        return F.cross_entropy(logits, batch[1])

    def validation_step(self, batch, batch_idx):
        logits = self(batch[0])
        self.val_f1(logits, batch[1])
        self.log("val_f1", self.val_f1)
        self.val_acc.update(logits, batch[1])
        self.log("val_acc", self.val_acc)
        self.val_set.update(logits, batch[1])
        self.log_dict(self.val_set)


def _metrics_of_one_epoch(tmp_path: Path, model_class: type, plan: dict, seed: int, batches: int) -> tuple[dict[str, float], dict[str, float]]:
    """``callback_metrics`` after one epoch with validation (8-row batches of 5 features, 3
    classes) on ``plan`` over 2 processes, and under plain Lightning."""
    g = torch.Generator().manual_seed(seed)
    train = [(torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)) for _ in range(batches)]
    val = [(torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)) for _ in range(batches)]

    def fit(strategy, devices: int) -> dict[str, float]:
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=devices, precision="64-true", max_epochs=1, logger=False,
            num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=str(tmp_path),
        )
        trainer.fit(model_class(), DataLoader(train, batch_size=None), DataLoader(val, batch_size=None))
        return {name: float(value) for name, value in trainer.callback_metrics.items()}

    return fit(DappleStrategy(plan=plan, timeout_s=60, start_method="spawn"), 2), fit("auto", 1)


@pytest.mark.timeout(300)
def test_torchmetrics_objects_log_what_they_log_under_plain_lightning(tmp_path: Path) -> None:
    """Two stages, M = 2: the last stage's ranks update the metrics with the rows they hold
    and every rank logs its own copy; the epoch values are one device's compute()."""
    plan = {"global_batch_size": 8, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 3], "devices": [1]}]}
    ours, plain = _metrics_of_one_epoch(tmp_path, Scored, plan, seed=12, batches=3)
    assert set(plain) == {"train_f1", "val_f1", "val_acc", "val_precision"} and set(ours) == set(plain)
    for name, value in plain.items():
        assert ours[name] == pytest.approx(value, abs=1e-12), name


class Extremes(Classifier):
    """Values logged with reduce_fx max, min and sum: the batch's largest logit, its
    smallest, and the count of right answers in it."""

    def _log_batch(self, stage: str, batch) -> torch.Tensor:
        logits = self(batch[0])
        self.log(f"{stage}_max", logits.max(), reduce_fx="max", on_step=False, on_epoch=True)
        self.log(f"{stage}_min", logits.min(), reduce_fx=torch.min, on_step=False, on_epoch=True)
        self.log(f"{stage}_right", (logits.argmax(-1) == batch[1]).sum().double(), reduce_fx="sum", on_step=False, on_epoch=True)
        return F.cross_entropy(logits, batch[1])

    def training_step(self, batch, batch_idx):
        return self._log_batch("train", batch)

    def validation_step(self, batch, batch_idx):
        self._log_batch("val", batch)


@pytest.mark.timeout(300)
def test_values_logged_with_reduce_fx_max_min_or_sum_combine_their_slices_that_way(tmp_path: Path) -> None:
    """One stage on two replicas, M = 2: each step's value is the max, min or sum over its
    four slices, so the epoch values are plain Lightning's."""
    plan = {"global_batch_size": 8, "micro_batches": 2, "stages": [{"layers": [0, 3], "devices": [0, 1]}]}
    ours, plain = _metrics_of_one_epoch(tmp_path, Extremes, plan, seed=16, batches=2)
    assert set(plain) == {f"{stage}_{what}" for stage in ("train", "val") for what in ("max", "min", "right")} == set(ours)
    for name, value in plain.items():
        assert ours[name] == pytest.approx(value, abs=1e-12), name


class Gathered(Classifier):
    """Per-sample losses kept by the validation steps and gathered at the epoch's end, the
    Lightning 2.x idiom; only the last stage ran the steps past self(x)."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []

    def validation_step(self, batch, batch_idx):
        self.outputs.append(F.cross_entropy(self(batch[0]), batch[1], reduction="none"))

    def on_validation_epoch_end(self):
        mine = torch.cat(self.outputs).mean() if self.outputs else torch.zeros((), dtype=torch.float64)
        self.log("val_mean", self.all_gather(mine).mean())
        self.outputs.clear()


@pytest.mark.timeout(300)
def test_all_gather_at_the_epochs_end_gathers_what_the_last_stage_holds(tmp_path: Path) -> None:
    plan = {"global_batch_size": 8, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 3], "devices": [1]}]}
    ours, plain = _metrics_of_one_epoch(tmp_path, Gathered, plan, seed=18, batches=2)
    assert ours["val_mean"] == pytest.approx(plain["val_mean"], abs=1e-12)


# --------------------------------------------------------------------------- parts of the model outside the pipeline


class Distilled(Classifier):
    """A frozen teacher outside the layers, called in the step under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(9)
        self.teacher = nn.Sequential(nn.Linear(5, 3)).requires_grad_(False)

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            soft = self.teacher(batch[0]).softmax(-1)
        return F.cross_entropy(self(batch[0]), soft)


def test_a_frozen_teacher_outside_the_layers_is_kept_untrained_and_distils_like_plain_lightning(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(10)
    data = [(torch.randn(4, 5, generator=g, dtype=torch.float64), torch.zeros(4, dtype=torch.long)) for _ in range(2)]

    def fit(strategy) -> dict:
        model = Distilled().double()
        Trainer(
            strategy=strategy, accelerator="cpu", devices=1, precision="64-true", max_steps=2, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        ).fit(model, DataLoader(data, batch_size=None))
        return model.state_dict()

    plan = {"global_batch_size": 4, "micro_batches": 2, "stages": [{"layers": [0, 3], "devices": [0]}]}
    ours, plain = fit(_dapple(plan=plan)), fit("auto")
    assert max(float((ours[k] - v).abs().max()) for k, v in plain.items()) < 1e-12
    assert torch.equal(ours["teacher.0.weight"], Distilled().double().state_dict()["teacher.0.weight"])  # untrained


def test_calling_a_layer_another_stage_holds_says_to_call_self() -> None:
    from lightning_dapple.strategy.module_adapter import FreedLayer

    with pytest.raises(DappleConfigError, match=r"layer 2: was called directly, but it lives on pipeline stage 1.*Fix: call self\(\.\.\.\)"):
        FreedLayer(2, 1)(torch.zeros(1))


class FrozenBackbone(Classifier):
    """Fine-tuning: the first Linear frozen, the optimizer built from the trained parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[0].requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


@pytest.mark.timeout(300)
def test_a_stage_of_frozen_layers_only_is_named_when_the_optimizer_gets_nothing(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"rank 0: .*configure_optimizers: failed on rank 0 \(optimizer got an empty parameter list\): "
                       r"its stage 0 \(layers \[0, 2\)\) holds no trained parameter.*Fix: give every stage a trained layer"):
        _fit_two_stages(tmp_path, FrozenBackbone(), cut=2)


class LoggedFrozenBackbone(FrozenBackbone):
    """The frozen first layers fill stage 0; the optimizer is built from self.parameters()."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(300)
def test_a_stage_training_nothing_logs_the_loss_in_the_modules_dtype(tmp_path: Path) -> None:
    """Rank 0 holds only frozen layers: its logged loss is float64 under 64-true all the
    same, equal to plain Lightning's."""
    g = torch.Generator().manual_seed(15)
    data = [(torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g)) for _ in range(2)]

    def fit(strategy, devices: int) -> torch.Tensor:
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=devices, precision="64-true", max_steps=2, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        )
        trainer.fit(LoggedFrozenBackbone(), DataLoader(data, batch_size=None))
        return trainer.callback_metrics["train_loss"]

    plan = {"global_batch_size": 4, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 3], "devices": [1]}]}
    ours, plain = fit(DappleStrategy(plan=plan, timeout_s=60, start_method="spawn"), 2), fit("auto", 1)
    assert ours.dtype == plain.dtype == torch.float64
    assert float(ours) == pytest.approx(float(plain), abs=1e-12)


# --------------------------------------------------------------------------- outputs that hold the batch in another dimension


class LastState(nn.Module):
    """A layer handing on nn.LSTM's (output, h_n): h_n is (num_layers, rows, hidden)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 4, batch_first=True)

    def forward(self, x):
        out, (h_n, _) = self.rnn(x)
        return out, h_n


class FromState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 3)

    def forward(self, pair):
        out, h_n = pair
        return self.head(torch.cat([out[:, -1], h_n[-1]], dim=-1))


def test_an_output_holding_rows_in_another_dimension_is_refused_where_a_cut_regroups_rows() -> None:
    """h_n's rows are in its second dimension: between 2 and 1 replicas it would be cut (or
    taken whole) along the first; between equal replica counts it passes untouched."""
    from lightning_dapple.plan.plan import plan_from_dict
    from lightning_dapple.strategy.layer_rows import check_regrouped_cuts, rows_elsewhere

    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), LastState(), FromState()]
    outputs = []
    for rows in (1, 2):
        value, each = torch.randn(rows, 5, 4), []
        for layer in layers:
            value = layer(value)
            each.append(value)
        outputs.append(each)
    found = rows_elsewhere(outputs, [1, 2])
    assert list(found) == [1] and found[1] == "(1, 1, 4) at 1 row, (1, 2, 4) at 2 rows"

    def plan(first_devices: list[int], cut: int) -> object:
        return plan_from_dict({"global_batch_size": 4, "micro_batches": 1, "stages": [
            {"layers": [0, cut], "devices": first_devices}, {"layers": [cut, 3], "devices": [len(first_devices)]}]})

    with pytest.raises(DappleConfigError, match=r"plan: cuts after layer 1, whose output holds the batch elsewhere.*between 2 and 1 replicas.*Fix: return batch-first"):
        check_regrouped_cuts(plan([0, 1], 2), found)
    check_regrouped_cuts(plan([0], 2), found)  # 1:1: each receiver gets its sender's tensors as they are
    check_regrouped_cuts(plan([0, 1], 1), found)  # a cut after a batch-first output


# --------------------------------------------------------------------------- layers frozen or unfrozen during training


class FineTuned(LightningModule):
    """Fine-tuning as Lightning's callbacks do it: ``BackboneFinetuning`` freezes
    ``self.backbone`` before training and unfreezes it at epoch 1 (a new param group), and
    another callback freezes a middle layer at epoch 2."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(8)
        self.layers = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
        self.backbone = nn.Sequential(self.layers[0])

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.05)


class FreezeMiddle(Callback):
    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 2:
            pl_module.layers[2].requires_grad_(False)


@pytest.mark.timeout(300)
def test_layers_unfrozen_and_frozen_by_callbacks_train_like_plain_lightning(tmp_path: Path) -> None:
    """The unfrozen backbone sits on a replicated stage (its gradients join the replicas'
    buckets from then on); the layer frozen later has its weight gradient deferred to W by
    out-of-order backprop, which must then give it nothing."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    g = torch.Generator().manual_seed(13)
    data = [(torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)) for _ in range(2)]

    plan = {"global_batch_size": 8, "micro_batches": 2, "ooo": True,
            "stages": [{"layers": [0, 3], "devices": [0, 1]}, {"layers": [3, 5], "devices": [2]}]}
    ours, plain = states_under_plan_and_plain(
        tmp_path, FineTuned, data, plan, max_steps=-1, max_epochs=4, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1), FreezeMiddle()]
    )
    start = FineTuned().double().state_dict()
    assert not torch.equal(plain["layers.0.weight"], start["layers.0.weight"])  # the backbone trained after epoch 1
    for name, value in plain.items():
        assert torch.allclose(ours[name], value, rtol=0, atol=1e-12), name
