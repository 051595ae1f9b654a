"""MMK12 reward: answer accuracy plus format, for responses to omnirl.data.mmk12.PROMPT_TEMPLATE.

reward = (accuracy + 0.15 * one_tag + 0.15 * boxed) / 1.3, in [0, 1]: one_tag, exactly one
<answer>...</answer>; boxed, a non-empty \\boxed{...} in it; accuracy, its content against the gold
answer (metadata[i]["answer"]): an option letter as a letter, anything else by math-verify as one
expression. The responses arrive as the `images` argument of the Reward protocol (text-output models pass
their response texts there). math-verify runs in a child process (this file run as a script) with its own
timeouts; an answer not judged within `timeout_s` counts as wrong and the child is restarted.

How each part is graded, and why a child process: docs/mmk12.md#the-reward.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import select
import subprocess
import sys
from typing import IO, Any

FORMAT_BONUS = 0.15
MAX_SCORE = 1.0 + 2 * FORMAT_BONUS
STARTUP_TIMEOUT_S = 120.0

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_LETTER = re.compile(r"^\(?([A-Z])(?:\)|[.:]|\s|$)")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} in `text` with balanced braces (None if there is none)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def option_letter(text: str) -> str | None:
    """The option letter an answer names: "B", "(B)", "B.", "\\text{B}", "$B$", "B. 12" -> "B"."""
    text = text.replace("\\text{", "").replace("\\mathrm{", "").replace("$", "").replace("}", "").strip()
    match = _LETTER.match(text)
    return match.group(1) if match else None


def score_response(response: str, gold: str, math_equal) -> float:
    """The reward of one response against the gold answer; `math_equal(gold, value) -> bool` compares
    two answer values (LaTeX without delimiters)."""
    tags = _ANSWER.findall(response)
    one_tag = len(tags) == 1 and response.count("<answer>") == 1 and response.count("</answer>") == 1
    boxed_value = last_boxed(tags[-1]) if tags else None
    boxed = one_tag and boxed_value is not None and boxed_value.strip() != ""
    correct = False
    if tags:
        graded = boxed_value if boxed_value is not None else tags[-1]
        if len(gold) == 1 and gold.isupper():
            correct = option_letter(graded) == gold
        elif graded.strip():
            correct = math_equal(gold, graded)
    return (float(correct) + FORMAT_BONUS * one_tag + FORMAT_BONUS * boxed) / MAX_SCORE


class Mmk12Reward:
    modality = "text"

    timeout_s = 10.0
    """Seconds one math-verify comparison may take before its child process is killed (scored wrong)."""

    def __init__(self) -> None:
        if importlib.util.find_spec("math_verify") is None:
            from omnirl.errors import ConfigError

            raise ConfigError("the mmk12 reward needs math-verify: pip install 'omnirl[math]'")
        self._proc: subprocess.Popen | None = None  # the math-verify child, started at the first use

    def __call__(self, images: list[str], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        # Imported here, not at the top: the math-verify child runs this module, and omnirl.data imports
        # torch (seconds of start-up the child does not need).
        from omnirl.errors import DataError

        scores = []
        for response, prompt, meta in zip(images, prompts, metadata):
            row = meta.get("source", repr(prompt))
            if not isinstance(response, str):
                raise TypeError(
                    f"{row}: the mmk12 reward scores response texts, got {type(response).__name__}"
                )
            gold = meta.get("answer")
            if not isinstance(gold, str) or not gold.strip():
                raise DataError(f'{row}: the mmk12 reward needs a non-empty string "answer", got {gold!r}')
            scores.append(score_response(response, gold.strip(), self.math_equal))
        return scores

    def math_equal(self, gold: str, pred: str) -> bool:
        """math-verify's verdict on gold vs predicted answer text, in the child process."""
        if self._proc is None:
            self._start()
        stdin, _ = self._pipes()
        try:
            stdin.write(json.dumps([gold, pred]) + "\n")
            stdin.flush()
        except BrokenPipeError:  # the child died after its last answer (e.g. killed for memory)
            self.close()
            return self.math_equal(gold, pred)
        answer = self._readline(self.timeout_s)
        if answer is None:  # hung (or died) on this answer
            self.close()
            return False
        return answer == "1"

    def _start(self) -> None:
        # A plain subprocess, not multiprocessing: spawn would re-import the user's main module, and fork
        # would copy the trainer's threads (reward pool, torch) in whatever state they are in.
        # This file by its path, not `-m omnirl.rewards.mmk12`: -m first imports the omnirl.rewards package
        # and through it torch, transformers and peft, seconds of start-up that a child which imports only
        # math-verify does not need (runpy, not the path as argv[0], which would put this folder on sys.path).
        serve = f"import runpy; runpy.run_path({__file__!r}, run_name='__main__')"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", serve],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        # The child says "ready" once math-verify is imported, so its start-up (seconds on a busy machine)
        # never counts against the timeout of an answer.
        if self._readline(STARTUP_TIMEOUT_S) != "ready":
            self.close()
            raise RuntimeError(f"the math-verify process did not start within {STARTUP_TIMEOUT_S} s")

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        """The running child's stdin and stdout (`_start` opens both as pipes)."""
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        return self._proc.stdin, self._proc.stdout

    def _readline(self, timeout: float) -> str | None:
        """The child's next line, or None if it wrote none within `timeout` s or has exited."""
        _, stdout = self._pipes()
        if not select.select([stdout], [], [], timeout)[0]:
            return None
        return stdout.readline().strip() or None

    def close(self) -> None:
        """Stop the math-verify process (the next free-form answer starts a new one)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            stdin, stdout = self._pipes()
            stdin.close()
            stdout.close()
            self._proc = None


def _serve() -> None:
    """The child (this file run as a script): reads JSON [gold, pred] lines from stdin and answers
    "1" or "0" per line, running math-verify in its main thread, where math-verify's timeouts work."""
    import logging

    from math_verify import parse, verify

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else that prints goes to stderr, never into the answers
    # math-verify logs every answer it cannot parse; a model's odd answers are not events worth a line.
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    print("ready", file=out, flush=True)
    for line in sys.stdin:
        gold, pred = json.loads(line)
        try:
            # Both are wrapped in \boxed{}: math-verify extracts LaTeX only between delimiters, and the
            # box makes the whole value one expression (parsed bare, "13 or 12" would grade its last number).
            ok = bool(verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + pred + "}")))
        except Exception:  # a parse or comparison error is a wrong answer, not a crashed reward
            ok = False
        print("1" if ok else "0", file=out, flush=True)


if __name__ == "__main__":
    _serve()
