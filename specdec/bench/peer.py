"""The bench's peer: plain greedy decoding of the same model through transformers ``generate``, in a subprocess.

transformers reads the same GGUF the model store converted (offline,
``HF_HUB_OFFLINE=1``, like ``tests/support/hf_reference.py``) in a process of its own,
so its import-time state and threads stay out of the bench process. The child
loads once, then serves one prompt per line of stdin (JSON in, JSON out), and
the parent times nothing while it waits: the child's wall time per prompt
(``generate`` only) comes back with the tokens. The parent interleaves these
runs with the engine's plain runs on the same prompts, batch 1, greedy, same
``max_tokens`` and stop tokens.

Run as ``python -m specdec.bench.peer GGUF DTYPE THREADS``; not a user command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from specdec.bench.runner import RunRecord, RunSpec
from specdec.bench.suites import Batch
from specdec.host_allocator import keep_freed_memory

PEER = "transformers"
PROMPT_LOOKUP = "transformers-pld"
"""transformers' own speculative decoding (prompt lookup: drafts copied from the prompt), served by the same child."""


class PeerUnavailable(RuntimeError):
    """transformers is missing or the child failed to load the model; the bench goes on without the peer."""


class TransformersPeer:
    """A runner (``specdec.bench.runner.Runner``) backed by the child process."""

    name = PEER

    def __init__(self, gguf: Path, *, dtype: str, threads: int) -> None:
        self.info: dict[str, Any] = {}
        self._log = tempfile.TemporaryFile(mode="w+", encoding="utf-8")  # noqa: SIM115 - the child's stderr until close()
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "specdec.bench.peer", str(gguf), dtype, str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            self._log.seek(0)
            tail = self._log.read()[-2000:]
            raise PeerUnavailable(f"the transformers peer exited (code {self._proc.poll()}): {tail.strip()}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise PeerUnavailable(str(answer["error"]))
        return answer

    def wait_ready(self) -> dict[str, Any]:
        """Block until the child has loaded the model; its versions and load time."""
        if not self.info:
            self.info = self._read()
        return self.info

    def supports(self, batch_size: int, spec: RunSpec) -> bool:
        return batch_size == 1 and spec.greedy

    def run(self, batch: Batch, spec: RunSpec, repeat: int) -> RunRecord:
        return self.generate(self.name, 0, batch, spec, repeat)

    def prompt_lookup(self, num_tokens: int) -> PromptLookupPeer:
        """transformers' prompt-lookup decoding as a runner of its own, served by this peer's child."""
        return PromptLookupPeer(self, num_tokens)

    def generate(self, name: str, prompt_lookup: int, batch: Batch, spec: RunSpec, repeat: int) -> RunRecord:
        """One ``generate`` in the child (with ``prompt_lookup_num_tokens`` when it is above 0), as ``name``."""
        if not self.supports(batch.size, spec):
            raise ValueError(f"the transformers peer runs batch 1 greedy only, not {batch.key} at T={spec.temperature}")
        self.wait_ready()
        assert self._proc.stdin is not None
        prompt = batch.prompts[0]
        request = {
            "ids": list(prompt.ids),
            "max_new_tokens": spec.max_tokens,
            "eos": list(spec.stop_token_ids),
            "prompt_lookup": prompt_lookup,
        }
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        answer = self._read()
        return RunRecord(
            runner=name,
            suite=batch.suite,
            batch_size=1,
            batch_key=batch.key,
            temperature=0.0,
            repeat=repeat,
            prompt_ids=[prompt.id],
            outputs=[list(answer["tokens"])],
            wall_s=float(answer["wall_s"]),
            steps=len(answer["tokens"]),
        )

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()


class PromptLookupPeer:
    """transformers ``generate(prompt_lookup_num_tokens=N)``: its own speculative peer, next to its plain generate."""

    name = PROMPT_LOOKUP

    def __init__(self, peer: TransformersPeer, num_tokens: int) -> None:
        if num_tokens < 1:
            raise ValueError(f"prompt lookup drafts at least 1 token, got {num_tokens}")
        self.peer = peer
        self.num_tokens = num_tokens

    def supports(self, batch_size: int, spec: RunSpec) -> bool:
        return self.peer.supports(batch_size, spec)

    def run(self, batch: Batch, spec: RunSpec, repeat: int) -> RunRecord:
        return self.peer.generate(self.name, self.num_tokens, batch, spec, repeat)


# -- the child ---------------------------------------------------------------------------------------------------


def _serve(gguf: Path, dtype_name: str, threads: int, proto: IO[str]) -> int:
    def say(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        import torch
        import transformers
    except ImportError as exc:
        say({"error": f"transformers is not installed ({exc}); install the bench extra: pip install 'specdec[bench]'"})
        return 1
    if dtype_name not in ("float32", "bfloat16"):
        say({"error": f"dtype must be float32 or bfloat16, got {dtype_name!r}"})
        return 2
    torch.set_num_threads(threads)
    allocator = keep_freed_memory()  # the same allocator settings as the engine it is compared with
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    start = time.perf_counter()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype_name)
        ).eval()
    except Exception as exc:  # report whatever the loader raised; the bench goes on without the peer
        say({"error": f"transformers could not load {gguf}: {type(exc).__name__}: {exc}"})
        return 1
    say(
        {
            "ready": True,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "load_s": time.perf_counter() - start,
            "threads": torch.get_num_threads(),
            "dtype": dtype_name,
            "allocator": allocator,
        }
    )
    for line in sys.stdin:
        request = json.loads(line)
        ids = torch.tensor([request["ids"]], dtype=torch.int64)
        eos = [int(t) for t in request["eos"]]
        lookup = int(request.get("prompt_lookup", 0))
        config = transformers.GenerationConfig(
            max_new_tokens=int(request["max_new_tokens"]),
            do_sample=False,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else 0,
            **({"prompt_lookup_num_tokens": lookup} if lookup > 0 else {}),
        )
        with torch.inference_mode():
            began = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            wall = time.perf_counter() - began
        say({"tokens": out[0, ids.shape[1] :].tolist(), "wall_s": wall})
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m specdec.bench.peer GGUF float32|bfloat16 THREADS", file=sys.stderr)
        return 2
    sys.stdout.flush()
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # anything a library prints (Python or C) goes to the log, never into the protocol
    return _serve(Path(argv[0]), argv[1], int(argv[2]), proto)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
