"""The GRPO example's options, its command line and what it prints (:mod:`fsm_rollout.examples.grpo` is the loop)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsm_rollout import MismatchReport, Sample
from fsm_rollout.examples.grpo_tiny import DEFAULT_KINDS

__all__ = ["GRPOOptions", "GRPORun", "StepReport", "parse_args", "summary"]

DESCRIPTION = "GRPO on the CPU: the embedded engine samples, a torch copy of the model learns, the weights go back."


@dataclass(frozen=True)
class GRPOOptions:
    """What one run does; the command-line flags set these (``--help`` says what each means)."""

    steps: int = 20
    asynchronous: bool = False
    groups: int = 2
    group_size: int = 16
    max_turns: int = 2
    max_new_tokens: int = 100
    learning_rate: float = 2e-3
    optimizer: str = "adamw"
    clip: float = 0.2
    max_staleness: int = 1
    correction: str = "none"  # the mismatch correction in the loss: "tis", "icepop" or "none"
    tree: bool = False  # the forward pass on the step's token tree (shared prefixes once) instead of padded rows
    tree_max_tokens: int = 8_192
    seed: int = 0
    question_seed: int = 2_024
    candidates: int = 16
    screen_samples: int = 4
    screen_finalists: int = 6
    kinds: tuple[str, ...] = DEFAULT_KINDS
    train_live_rows: bool = True
    model_dir: Path | None = None
    env_factory: Any = None  # build_env(*, sample, args) of the environment; default: grpo_tiny.NearMissEnv's


FLAGS: dict[str, tuple[str, str]] = {  # option -> (flag, help)
    "steps": ("--steps", "optimizer steps"),
    "groups": ("--groups", "questions per step"),
    "group_size": ("--group-size", "samples per question"),
    "max_turns": ("--max-turns", "attempts per sample"),
    "max_new_tokens": ("--max-new-tokens", "response budget per sample"),
    "learning_rate": ("--lr", "learning rate"),
    "clip": ("--clip", "ratio clip range"),
    "max_staleness": ("--max-staleness", "drop samples whose oldest token is more versions behind than this"),
    "candidates": ("--candidates", "practice questions screened for the pool (0: no screen)"),
    "screen_samples": ("--screen-samples", "samples per screened question"),
    "screen_finalists": ("--screen-finalists", "best screened questions that get 2 x --screen-samples more (0: none)"),
    "tree_max_tokens": ("--tree-max-tokens", "with --tree: tokens per packed batch (one forward pass each)"),
    "seed": ("--seed", "seed of torch and of every group's sampling"),
}
CORRECTIONS = ("none", "tis", "icepop")
AT_LEAST_ONE = ("tree_max_tokens", "steps", "groups", "group_size", "max_turns", "max_new_tokens", "screen_samples")


def parse_args(argv: Sequence[str] | None = None) -> GRPOOptions:
    defaults = GRPOOptions()
    parser = argparse.ArgumentParser(prog="python -m fsm_rollout.examples.grpo", description=DESCRIPTION,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    for name, (flag, text) in FLAGS.items():
        default = getattr(defaults, name)
        parser.add_argument(flag, dest=name, type=type(default), default=default, help=text)
    parser.add_argument("--async", dest="asynchronous", action="store_true",
                        help="roll out the next step while this one trains; the update lands mid-rollout")  # fmt: skip
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default=defaults.optimizer, help="optimizer")
    parser.add_argument("--correction", choices=list(CORRECTIONS), default=defaults.correction,
                        help="weigh each token's loss by its train/inference mismatch weight")  # fmt: skip
    parser.add_argument("--tree", action="store_true",
                        help="train from the token tree: a group's shared prompt is computed once")  # fmt: skip
    parser.add_argument("--kinds", default=",".join(defaults.kinds), help="practice question kinds screened")
    parser.add_argument("--model", type=Path, default=None, metavar="DIR",
                        help="policy and served model (None: the embedded engine's default model)")  # fmt: skip
    args = vars(parser.parse_args(argv))
    for name in FLAGS:
        if args[name] < (1 if name in AT_LEAST_ONE else 0):
            parser.error(f"{FLAGS[name][0]} must be >= {1 if name in AT_LEAST_ONE else 0}")
    kinds = tuple(kind.strip() for kind in args.pop("kinds").split(",") if kind.strip())
    model_dir = args.pop("model")
    return GRPOOptions(**args, kinds=kinds, model_dir=model_dir)


@dataclass
class StepReport:
    """What one step measured."""

    step: int
    reward: float
    gap_mean: float
    gap_max: float
    tokens: int
    samples: int
    samples_per_s: float
    seconds: float
    versions: list[str] = field(default_factory=list)
    stale_tokens: int = 0
    dropped: int = 0
    suspended: int = 0
    k3: float = 0.0
    worst: str = ""
    """The event group of the largest K3: ``dimension=label``."""

    @classmethod
    def of(cls, step: int, groups: Sequence[Sequence[Sample]], mismatch: MismatchReport, *, stale: int,
           dropped: int, rollout_s: float, started: float) -> StepReport:  # fmt: skip
        """The report of a step that trained on ``groups`` (``started``: when its training began, perf_counter);
        the logprob gap is ``mismatch``'s |delta| over the trained tokens."""
        gaps = [abs(float(gap)) for gap in mismatch.log_ratio[mismatch.trained]]
        worst = mismatch.worst_event()
        samples = [sample for group in groups for sample in group]
        spans = [span for sample in samples for span in sample.metadata.get("weight_version_spans") or []]
        versions = {str(span["version"]) for span in spans}
        return cls(
            step=step,
            reward=statistics.fmean(float(sample.reward or 0.0) for sample in samples),
            gap_mean=statistics.fmean(gaps) if gaps else 0.0,
            gap_max=max(gaps, default=0.0),
            tokens=sum(sum(1 for bit in sample.loss_mask or [] if bit == 1) for sample in samples),
            samples=len(samples),
            samples_per_s=len(samples) / rollout_s if rollout_s > 0 else 0.0,
            seconds=rollout_s + time.perf_counter() - started,
            versions=sorted(versions, key=int),
            stale_tokens=stale,
            dropped=dropped,
            k3=mismatch.k3,
            worst="" if worst is None else f"{worst.dimension}={worst.label} (K3 {worst.k3:.2e})",
        )

    def line(self) -> str:
        text = (
            f"step {self.step:3d}  reward {self.reward:.3f}  logprob gap mean {self.gap_mean:.2e} max "
            f"{self.gap_max:.2e}  K3 {self.k3:.2e}  worst {self.worst or '-'}  tokens {self.tokens}  "
            f"{self.samples_per_s:.2f} samples/s  {self.seconds:.1f} s"
        )
        if self.suspended or self.stale_tokens or self.dropped:
            text += f"  suspended {self.suspended}  stale tokens {self.stale_tokens}  dropped {self.dropped}"
        return text + f"  versions {','.join(self.versions)}"


def summary(reports: Sequence[StepReport], seconds: float) -> dict[str, Any]:
    """The closing JSON object: steps, first and last reward, the logprob gap's mean and max, minutes."""
    return {
        "steps": len(reports),
        "reward_first": round(reports[0].reward, 4) if reports else None,
        "reward_last": round(reports[-1].reward, 4) if reports else None,
        "logprob_gap_mean": statistics.fmean(report.gap_mean for report in reports) if reports else 0.0,
        "logprob_gap_max": max((report.gap_max for report in reports), default=0.0),
        "minutes": round(seconds / 60, 3),
    }


@dataclass
class GRPORun:
    """What :func:`train` returns: the final JSON object, every step's report, and how far the weights moved."""

    summary: dict[str, Any]
    reports: list[StepReport]
    weight_change: float
    """The largest absolute change of any parameter between the first and the last weights."""
