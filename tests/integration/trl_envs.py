"""A TRL ``environment_factory`` class in the shape TRL's docs give one: ``reset(**kwargs)`` returning text for the
prompt, public methods with type hints and Google-style docstrings as tools, and ``get_reward``."""

from __future__ import annotations

from typing import Any


class HiddenNumberEnv:
    """Find the row's hidden number with the ``probe`` tool, then say it."""

    def reset(self, **kwargs: Any) -> str:
        self.secret = int(kwargs["secret"])
        self.probes = 0
        self.found = False
        return " Use the probe tool to compare a number with the hidden one."

    def probe(self, number: int) -> str:
        """
        Compare a number with the hidden number.

        Args:
            number: The number to compare.

        Returns:
            Whether the hidden number is higher, lower or equal.
        """
        self.probes += 1
        if number == self.secret:
            self.found = True
            return "equal"
        return "higher" if self.secret > number else "lower"

    def get_reward(self) -> float:
        return 1.0 / self.probes if self.found else 0.0
