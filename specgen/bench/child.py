"""A baseline's process of its own (bench/hf.py: transformers; bench/llamacpp.py: llama.cpp).

Contract: `JsonChild(argv, what)` starts `argv` and talks to it one JSON object a line: `ask(request)`
writes one line to its stdin and returns the line it answers on its stdout, parsed. Its stderr goes to
a temporary file, not a pipe (a native library that logs more than a pipe's 64 KiB to a pipe nobody
reads would block there, and the bench with it). If the child dies, `ask` raises `ChildDied` with its
exit code and the tail of what it wrote to stderr. `close()` ends it (stdin closed: the child's loop
ends) and drops the file.
"""

from __future__ import annotations

import json
import subprocess
import tempfile


class ChildDied(RuntimeError):
    """A baseline's process ended while it was asked something."""


class JsonChild:
    def __init__(self, argv: list[str], what: str) -> None:
        self.what = what
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        text=True)

    def ask(self, request: dict) -> dict:
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except OSError:                 # a broken pipe: it died before reading the request
            line = ""
        if not line:
            code = self.process.wait()
            self.log.seek(0)
            tail = " ".join(self.log.read()[-2000:].split())
            raise ChildDied(f"the {self.what} process died (exit code {code}): {tail}")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)
        self.log.close()
