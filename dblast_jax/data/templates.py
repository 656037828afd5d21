"""Benchmark prompt templates (as the public DFlash benchmark writes them) and chats.

The templates turn a set's raw text into the user message the model sees. They are
applied at evaluation time; `Prompt.turns` keep the raw text (what dedup compares).
"""

from __future__ import annotations

from typing import Optional, Sequence

from dblast_jax.data.sources import Prompt

__all__ = ["GSM8K_TEMPLATE", "HUMANEVAL_TEMPLATE", "benchmark_turns", "chat_messages"]

GSM8K_TEMPLATE = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
HUMANEVAL_TEMPLATE = ("Write a solution to the following problem and make sure that it passes "
                      "the tests:\n```python\n{prompt}\n```")


def benchmark_turns(prompt: Prompt) -> list[str]:
    """The user turns of `prompt` as the benchmark sends them.

    GSM8K and HumanEval wrap their single turn in the fixed templates; MT-Bench keeps its
    two turns (each sent after the model's answer to the previous one); every other set
    is sent as is.
    """
    if prompt.source == "gsm8k":
        return [GSM8K_TEMPLATE.format(question=prompt.turns[0])]
    if prompt.source == "humaneval":
        return [HUMANEVAL_TEMPLATE.format(prompt=prompt.turns[0])]
    return list(prompt.turns)


def chat_messages(turns: Sequence[str], answers: Sequence[str] = (),
                  system: Optional[str] = None) -> list[dict]:
    """Messages for the next model turn: user turns interleaved with earlier answers.

    `answers` holds the model's replies to the first len(answers) turns; the result ends
    with user turn len(answers) (multi-turn benchmarks call this once per turn).
    """
    if len(answers) >= len(turns):
        raise ValueError(f"{len(answers)} answers leave no user turn to send "
                         f"(the prompt has {len(turns)} turns)")
    messages = [{"role": "system", "content": system}] if system else []
    for i, answer in enumerate(answers):
        messages += [{"role": "user", "content": turns[i]},
                     {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": turns[len(answers)]})
    return messages
