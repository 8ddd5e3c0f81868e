"""Two verifiers environments built with verifiers' own classes, as its docs build them: a ``ToolEnv`` with a
Python tool and a rubric, and a ``MultiTurnEnv`` game with its own ``env_response``, stop condition and state."""

from __future__ import annotations

from typing import Any


def load_tool_environment(max_turns: int = 4) -> Any:
    import verifiers as vf
    from datasets import Dataset

    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return a * b

    parser = vf.Parser()

    def correct_answer(completion: Any, answer: str, **_: Any) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    def used_few_tools(completion: Any, **_: Any) -> float:
        calls = sum(len(message.tool_calls or []) for message in completion if message.role == "assistant")
        return 1.0 if calls <= 1 else 0.0

    rubric = vf.Rubric(funcs=[correct_answer, used_few_tools], weights=[1.0, 0.5], parser=parser)
    dataset = Dataset.from_list(
        [{"question": "What is 6 times 7?", "answer": "42"}, {"question": "What is 3 times 5?", "answer": "15"}]
    )
    return vf.ToolEnv(
        dataset=dataset,
        tools=[multiply],
        rubric=rubric,
        parser=parser,
        max_turns=max_turns,
        system_prompt="Use the multiply tool, then answer with the number only.",
    )


def load_game_environment(**kwargs: Any) -> Any:
    import verifiers as vf
    from datasets import Dataset

    def last_guess(state: Any) -> str:
        trajectory = state["trajectory"]
        return (trajectory[-1]["completion"][-1].content or "").strip().lower() if trajectory else ""

    class ColdHotEnv(vf.MultiTurnEnv):
        """Guess a word: a wrong guess is answered "cold"; the right one ends the game (a stop condition)."""

        async def setup_state(self, state: Any) -> Any:
            state["wrong_guesses"] = 0
            return state

        @vf.stop
        async def word_found(self, state: Any) -> bool:
            return last_guess(state) == state["answer"]

        async def env_response(self, messages: Any, state: Any, **_: Any) -> Any:
            state["wrong_guesses"] += 1
            return [vf.UserMessage(content=f"{last_guess(state)!r} is cold. Guess again.")]

    def found(state: Any, **_: Any) -> float:
        return 1.0 if last_guess(state) == state["answer"] else 0.0

    def quick(state: Any, **_: Any) -> float:
        return 1.0 / (1 + state["wrong_guesses"])

    dataset = Dataset.from_list([{"question": "Guess the animal.", "answer": "otter"}])
    return ColdHotEnv(dataset=dataset, rubric=vf.Rubric(funcs=[found, quick], weights=[1.0, 0.0]), max_turns=5)
