"""Models trained by decentral."""

from decentral.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
