"""The ``tree`` bench workload's token counts (the model's timing part is not run here: it loads the default model)."""

from __future__ import annotations

from fsm_rollout.cli.bench.tree import GROUP, agent_batch_figures, build_and_pack_figures


def test_the_agent_batch_processes_at_most_a_third_of_the_flat_tokens() -> None:
    figures = agent_batch_figures(quick=True)
    assert figures["agent_sequences"] == 2 * GROUP * 4  # two groups, each rollout forked three times
    assert figures["agent_trained_tokens"] == figures["agent_sequences"] * 128  # every answer, once
    # every sequence holds its group's 1,024-token prompt; the tree holds it once per group
    assert figures["agent_flat_tokens"] >= figures["agent_sequences"] * (1_024 + 128 + 32)
    assert figures["agent_tree_over_flat"] <= 1 / 3
    assert figures["agent_tree_tokens_per_trained"] < figures["agent_flat_tokens_per_trained"]


def test_build_and_pack_reports_its_samples() -> None:
    figures = build_and_pack_figures(quick=True)
    assert figures["build_pack_samples"] == 2_000 and figures["build_pack_cpu_s"] > 0
