"""Rewards for `generate(reward=...)`: functions from the generated text to a number.

`doctest_reward(problem)`: for a HumanEval-style problem, the fraction of the `>>>` examples in
its docstrings that the code in the reply passes, checked as `doctest` checks them. The code
runs in a separate Python process under a guard: a wall-clock timeout, kernel limits on memory,
CPU time and file size, the calls that delete, overwrite, kill or spawn turned into errors, and
files writable only in a scratch folder. A reply that loops, crashes or tries harm scores 0
without hurting the sampler or the machine (a guard against accidents, not a sandbox).
"""

from __future__ import annotations

import ast
import doctest
import inspect
import json
import math
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable

CODE_BLOCK = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)
EXAMPLE_START = re.compile(r"^(?=[ \t]*>>> )", re.MULTILINE)
MEMORY_MB = 1024
FILE_BYTES = 1 << 20

# os / posix / shutil / subprocess functions a reply may not call (see `_disable_harmful_calls`).
HARMFUL_CALLS = {
    "os": (
        "system popen remove unlink rmdir removedirs rename renames replace truncate ftruncate "
        "kill killpg fork forkpty execv execve execl execle execlp execlpe execvp execvpe "
        "spawnv spawnve spawnvp spawnvpe spawnl spawnle spawnlp spawnlpe posix_spawn "
        "posix_spawnp putenv unsetenv chmod fchmod lchmod chown fchown lchown chdir fchdir "
        "chroot link symlink mkfifo mknod setuid seteuid setgid setegid setsid"
    ),
    "shutil": "rmtree move chown copyfile copy copy2 copytree",
    "subprocess": "Popen run call check_call check_output getoutput getstatusoutput",
}


def extract_code(text: str, entry_point: str) -> str:
    """The function the model wrote: the first fenced block that defines `entry_point`, else the
    first fenced block, else the whole reply."""
    blocks = CODE_BLOCK.findall(text)
    for block in blocks:
        if re.search(rf"def\s+{re.escape(entry_point)}\s*\(", block):
            return block
    return blocks[0] if blocks else text


def doctest_examples(prompt: str) -> list[tuple[str, str]]:
    """(source, expected output) of every `>>>` example in the prompt's docstrings, as
    `doctest.DocTestParser` reads them (multi-line outputs, `...` continuation lines). An
    example without output is a statement, except a comparison (`f(x) == y`, as some HumanEval
    prompts write their examples), whose expected output is True."""
    return [(e.source.rstrip("\n"), e.want.rstrip("\n")) for e in _examples(prompt)]


def doctest_reward(
    problem: dict, timeout: float = 5.0, memory_mb: int = MEMORY_MB
) -> Callable[[str], float]:
    """r(text) = passed / total over the problem's examples that have an expected output
    (0 without any). The reply runs for at most `timeout` seconds (wall clock and CPU) in at
    most `memory_mb` MiB of address space."""
    examples = _examples(problem["prompt"])
    checks = sum(1 for e in examples if e.want or e.exc_msg)
    header = "\n".join(
        line for line in problem["prompt"].splitlines() if line.startswith(("import ", "from "))
    )
    guard = {
        "memory_bytes": memory_mb << 20,
        "cpu_seconds": math.ceil(timeout),
        "file_bytes": FILE_BYTES,
        "harmful": HARMFUL_CALLS,
    }
    examples_json = [_example_json(e) for e in examples]

    def reward(text: str) -> float:
        if not checks:
            return 0.0
        code = f"{header}\n{extract_code(text, problem['entry_point'])}\n"
        job = json.dumps({"code": code, "examples": examples_json, **guard})
        with tempfile.TemporaryDirectory() as scratch:
            try:
                done = subprocess.run(
                    [sys.executable, "-I", "-c", _CHILD],
                    input=job,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    cwd=scratch,
                )
                passed = int(done.stdout.strip().splitlines()[-1])
            except (subprocess.TimeoutExpired, ValueError, IndexError):
                return 0.0  # a loop, a crash before the harness ran, or no output: nothing passed
        return min(max(passed, 0), checks) / checks

    return reward


def _examples(prompt: str) -> list[doctest.Example]:
    """The examples of every docstring in the prompt (the whole prompt if it does not parse)."""
    try:
        tree = ast.parse(prompt)
        docs = [ast.get_docstring(node) for node in ast.walk(tree) if _has_docstring(node)]
    except SyntaxError:
        docs = [prompt]
    examples = [e for doc in docs if doc for e in _parse(doc)]
    for e in examples:
        if not e.want and _is_comparison(e.source):
            e.want = "True\n"
    return examples


def _has_docstring(node: ast.AST) -> bool:
    return isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)


def _parse(doc: str) -> list[doctest.Example]:
    """doctest's parse; if one example is malformed (a "\\n" inside a non-raw docstring breaks
    its lines), the others still count."""
    parser = doctest.DocTestParser()
    try:
        return parser.get_examples(doc)
    except ValueError:
        examples = []
        for chunk in EXAMPLE_START.split(doc):
            try:
                examples += parser.get_examples(chunk)
            except ValueError:
                continue
        return examples


def _is_comparison(source: str) -> bool:
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    return (
        len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Compare)
    )


def _example_json(e: doctest.Example) -> dict:
    return {
        "source": e.source,
        "want": e.want,
        "exc_msg": e.exc_msg,
        "options": {str(flag): on for flag, on in e.options.items()},
    }


# -- what runs in the child process (standard library only, imports inside) -------------------


def _limit_resources(memory_bytes: int, cpu_seconds: int, file_bytes: int) -> None:
    """Limits the kernel enforces on the child: past the address-space limit an allocation
    raises MemoryError; past the CPU limit the child gets SIGXCPU (then SIGKILL a second
    later); a write past the file-size limit fails. No core dumps."""
    import resource

    def cap(limit: int, soft: int, hard: int) -> None:
        _, current = resource.getrlimit(limit)
        if current != resource.RLIM_INFINITY:
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(limit, (soft, hard))

    cap(resource.RLIMIT_AS, memory_bytes, memory_bytes)
    cap(resource.RLIMIT_CPU, cpu_seconds, cpu_seconds + 1)
    cap(resource.RLIMIT_FSIZE, file_bytes, file_bytes)
    cap(resource.RLIMIT_CORE, 0, 0)


def _disable_harmful_calls(harmful: dict[str, str]) -> None:
    """Calls that delete, overwrite, kill, spawn or leave the scratch folder raise
    PermissionError instead; `posix` too, so reloading `os` does not bring them back. This is
    a guard against accidents, not a sandbox: ctypes, for one, gets past it."""
    import importlib

    def refused(*args: object, **kwargs: object) -> None:
        raise PermissionError("disabled while a reply is scored")

    harmful = {**harmful, "posix": harmful["os"]}
    for module_name, names in harmful.items():
        module = importlib.import_module(module_name)
        for name in names.split():
            if hasattr(module, name):
                setattr(module, name, refused)


def _confine_writes() -> None:
    """Files open for writing only inside the scratch folder (the working directory)."""
    import builtins
    import io
    import os
    import posix

    folder = os.path.realpath(os.getcwd())
    open_file, open_fd = io.open, os.open
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def check(path: object) -> None:
        if isinstance(path, int):
            return  # an already open descriptor
        full = os.path.realpath(os.fsdecode(path))
        if os.path.commonpath([folder, full]) != folder:
            raise PermissionError(f"writing {full} is disabled while a reply is scored")

    def confined_open(file: object, mode: str = "r", *args: object, **kwargs: object):
        if any(c in mode for c in "wax+"):
            check(file)
        return open_file(file, mode, *args, **kwargs)

    def confined_os_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if flags & writing:
            check(path)
        return open_fd(path, flags, *args, **kwargs)

    builtins.open = io.open = confined_open
    os.open = posix.open = confined_os_open


def _run_examples() -> None:
    """The child: read the job from stdin, run the reply's code, then every example in its
    namespace as doctest does, and write how many examples with an expected output passed."""
    import ast
    import contextlib
    import doctest
    import json
    import os
    import sys

    job = json.loads(sys.stdin.read())
    result = os.dup(1)  # only the count goes back: the reply's prints go to /dev/null
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)

    class Checker(doctest.OutputChecker):
        """doctest's comparison, or equal Python literals (`(1,2)` passes for `(1, 2)`)."""

        def check_output(self, want: str, got: str, optionflags: int) -> bool:
            if super().check_output(want, got, optionflags):
                return True
            try:
                return ast.literal_eval(want.strip()) == ast.literal_eval(got.strip())
            except Exception:
                return False

    class Runner(doctest.DocTestRunner):
        """doctest's runner (the examples share one namespace), noting which ones pass."""

        def __init__(self, checker: doctest.OutputChecker, optionflags: int) -> None:
            super().__init__(checker, optionflags=optionflags)
            self.passed: list[doctest.Example] = []

        def report_success(self, out: object, test: object, example: object, got: str) -> None:
            self.passed.append(example)

    def flags(options: dict[str, bool]) -> dict[int, bool]:
        return {int(flag): on for flag, on in options.items()}

    _limit_resources(job["memory_bytes"], job["cpu_seconds"], job["file_bytes"])
    _disable_harmful_calls(job["harmful"])
    _confine_writes()
    scope: dict = {"__name__": "reply"}
    with contextlib.suppress(BaseException):  # what it defined before an error still counts
        exec(compile(job["code"], "<reply>", "exec"), scope)
    examples = [
        doctest.Example(e["source"], e["want"], e["exc_msg"], options=flags(e["options"]))
        for e in job["examples"]
    ]
    runner = Runner(Checker(), optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(doctest.DocTest(examples, scope, "reply", None, 0, None), out=lambda _: None)
    passed = sum(1 for e in runner.passed if e.want or e.exc_msg)
    os.write(result, f"{passed}\n".encode())


_CHILD = "\n\n".join(
    [
        inspect.getsource(_limit_resources),
        inspect.getsource(_disable_harmful_calls),
        inspect.getsource(_confine_writes),
        inspect.getsource(_run_examples),
        "_run_examples()",
    ]
)
