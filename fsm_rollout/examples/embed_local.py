"""The embedded engine in the trainer's own process, wired to a runner: the README's in-process example, verbatim.

Run it with ``python -m fsm_rollout.examples.embed_local``. It serves the default model in process, rolls out a
group of four samples of one demo question, pushes the trainer's copy of the weights through
``runner.weight_update``, rolls out a second group under the new version, and prints the runner's metrics, then
each sample's status, reason, reward and response length. The README shows everything below this docstring;
``tests/integration/test_readme_snippets.py`` checks that it does and runs it against the tiny random model.
"""

import asyncio
from pathlib import Path

from transformers import AutoModelForCausalLM

from fsm_rollout import RolloutConfig, RolloutRunner, Sample
from fsm_rollout.data.demo import demo_samples
from fsm_rollout.engine.local import LocalEngine

SAMPLING = {"max_new_tokens": 176, "temperature": 1.0, "top_p": 1.0, "stop": ["</tool_call>"], "no_stop_trim": True}


async def main(model_dir: Path | None = None) -> list[Sample]:
    # model_dir=None serves the default model (built and trained on first use, then cached)
    async with LocalEngine(model_dir, served_model_name="policy") as engine:
        config = RolloutConfig(
            engine_url=engine.url,  # http://127.0.0.1:<a free port>
            model=engine.served_model_name,  # the name every request carries
            tokenizer_path=str(engine.model_dir),  # the engine's own tokenizer: no hub lookup
            image_merge_size=engine.image_merge_size,  # the image-token check needs no processor
            env_path="fsm_rollout.envs.geo3k",
            max_turns=3,
        )
        policy = AutoModelForCausalLM.from_pretrained(engine.model_dir)  # the trainer's copy of the model
        async with RolloutRunner(config, sampling_params=SAMPLING) as runner:
            question = demo_samples()[0]  # one figure, the question, label = the answer
            samples = await runner.run_group(question, n=4, seed=0)
            # ... an optimizer step on `samples` changes `policy` here ...
            async with runner.weight_update(version="step-1"):  # rollouts in flight suspend; nothing is lost
                await engine.load_weights(policy.state_dict())  # copied between two decode steps
            samples += await runner.run_group(question, n=4, seed=4)
            metrics = runner.metrics()  # statuses and reasons count every sample since the runner started
            print(metrics.statuses, metrics.reasons, f"{metrics.turns} turns, {metrics.tokens_per_s:.0f} tok/s")
    return samples


if __name__ == "__main__":
    for sample in asyncio.run(main()):
        print(sample.status.value, sample.metadata["rollout_reason"], sample.reward, sample.response_length)
