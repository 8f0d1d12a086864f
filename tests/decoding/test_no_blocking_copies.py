"""The host waits for the device once per round: never inside the K draft steps of sd, smc and
msd.

Two checks, since neither sees everything:
- The source (an AST walk over smcspec/decoding and smcspec/sampling.py): every copy to a
  device passes non_blocking=True, and every read of a tensor's value on the host (.cpu(),
  .item(), .tolist(), .numpy(), int / float / bool of one, `sampling.to_host`) is listed below
  with its reason. It cannot tell a host tensor from a device one, so the host's own reads are
  listed too, marked "host"; it cannot see `if tensor:`.
- The behaviour: ar, sd, smc and msd decode with models on the meta device, which stands in for a
  GPU (shapes without values), under a dispatch mode that counts each read of a meta tensor
  on the host (answering zeros) and each host -> meta copy without non_blocking. That sees
  every read the run makes, implicit ones included, on the paths the run takes.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import smcspec
from smcspec.config import MSDConfig, SamplingConfig, SDConfig, SMCConfig
from smcspec.decoding import (
    AutoregressiveDecoder,
    MultiDraftDecoder,
    SMCDecoder,
    SpeculativeDecoder,
)

PACKAGE = Path(smcspec.__file__).parent
SOURCES = [*sorted((PACKAGE / "decoding").glob("*.py")), PACKAGE / "sampling.py"]

# Modules whose tensors all live on the host: decoders bring what they need there first.
HOST_MODULES = {
    "population.py": "the particles' tokens, lengths and weights are host tensors",
    "particles.py": "weights and ancestors [N] are host tensors",
    "guide.py": "potentials run on the host: the logits are moved there before (on_host)",
}

ROUND, EXTRA, HOST = "the round's one wait", "an extra wait, named", "a host tensor: no wait"
# (file, function, call) -> (kind, why). A plain round (no potential, no logprobs for sd) has
# exactly one ROUND read; EXTRA ones happen only in the case their reason names.
READS: dict[tuple[str, str, str], tuple[str, str]] = {
    (
        "smc.py",
        "SMCDecoder._round",
        "sampling.to_host(drafts, bonus, log_ratio, agree, *(scored or ()))",
    ): (
        ROUND,
        "weights, EOS and resampling are decided on the host, after the K draft steps and the "
        "verify pass are all queued",
    ),
    (
        "speculative.py",
        "SpeculativeDecoder._accept",
        "sampling.to_host(drafts, accepted, final, agree)",
    ): (
        ROUND,
        "the accept tests and the final draw ran on the device; the block is cut on the host",
    ),
    ("autoregressive.py", "AutoregressiveDecoder.draw", "sampling.to_host(token, *scored)"): (
        ROUND,
        "ar's round is one token, which the next step's context needs on the host",
    ),
    (
        "msd.py",
        "MultiDraftDecoder.round",
        "sampling.to_host(path, depth, winner, agree, *scored)",
    ): (
        ROUND,
        "the tree walk and the final draw ran on the device (the scores too, when asked for); "
        "the block is cut and the rows restarted on the host",
    ),
    ("methods.py", "configs_from_fields", "bool(given.get('allow_large'))"): (
        HOST,
        "a setting, not a tensor",
    ),
    ("msd.py", "MultiDraftDecoder.round", "path.tolist()"): (HOST, "read back"),
    ("agreement.py", "Tally.add", "float(values.sum())"): (HOST, "read back with the round"),
    ("msd.py", "MultiDraftDecoder.round", "int(depth)"): (HOST, "read back"),
    ("msd.py", "MultiDraftDecoder.round", "int(winner)"): (HOST, "read back"),
    ("smc.py", "SMCDecoder._exact_step", "sampling.to_host(token, *scored)"): (
        EXTRA,
        "a collapsed round (every weight zero) is known only after the round's wait",
    ),
    ("logprobs.py", "to_host", "sampling.to_host(chosen, ids, values)"): (
        EXTRA,
        "sd with logprobs: the block's scores, once the round's wait has decided the block; "
        "prompt scoring, once per chunk",
    ),
    ("smc.py", "SMCDecoder._round", "logits.cpu()"): (EXTRA, "with a potential (on_host)"),
    ("smc.py", "SMCDecoder._propose", "logits.cpu()"): (EXTRA, "with a potential (on_host)"),
    (
        "autoregressive.py",
        "AutoregressiveDecoder._decode",
        "(adjusted if greedy else logp).cpu()",
    ): (
        EXTRA,
        "with a potential, which runs on the host",
    ),
    ("sampling.py", "to_host", "pack(away).cpu()"): (EXTRA, "the one copy of to_host"),
    ("sampling.py", "_may_overflow", "float(lo)"): (HOST, "log_probs calls it on the CPU only"),
    ("sampling.py", "_may_overflow", "float(hi)"): (HOST, "log_probs calls it on the CPU only"),
    ("sampling.py", "sample_at", "total.tolist()"): (HOST, "read on the CPU only"),
    ("msd.py", "verify", "bool(walking)"): (HOST, "read on the CPU only"),
    ("msd.py", "verify", "int(alive.sum())"): (HOST, "read on the CPU only"),
    ("msd_lookup.py", "verify", "bool(walking)"): (HOST, "read on the CPU only"),
    ("msd_lookup.py", "verify", "bool(testing)"): (HOST, "read on the CPU only"),
    **{
        ("msd_block.py", scope, call): (
            EXTRA,
            'msd with verify="block" reads each stop of its walk (up to N + 1 a round)',
        )
        for scope, call in (
            ("verify", "int(alive.sum())"),
            ("verify", "bool(passed.any())"),
            ("verify", "int(passed.long().argmax())"),
            ("_stop", "int(tau)"),
        )
    },
    ("lookup.py", "LookupTally._count", "bool(proposed)"): (HOST, "a list of token ids"),
    ("lookup.py", "LookupTally.found_rate", "bool(o.proposed)"): (HOST, "a list of token ids"),
    ("autoregressive.py", "AutoregressiveDecoder.draw", "int(token)"): (HOST, "read back above"),
    ("speculative.py", "SpeculativeDecoder._accept", "drafts.tolist()"): (HOST, "read back"),
    ("speculative.py", "SpeculativeDecoder._propose", "seq[0].tolist()"): (
        HOST,
        "the committed text, kept on the host (a lookup proposal searches it)",
    ),
    ("msd.py", "MultiDraftDecoder._lookup", "seq[0].tolist()"): (
        HOST,
        "the committed text, kept on the host (the lookup draft searches it)",
    ),
    ("speculative.py", "SpeculativeDecoder._accept", "int(accepted)"): (HOST, "read back"),
    ("speculative.py", "SpeculativeDecoder._accept", "int(final)"): (HOST, "read back"),
    ("logprobs.py", "to_host", "ids.tolist()"): (HOST, "read back above"),
    ("logprobs.py", "to_host", "values.tolist()"): (HOST, "read back above"),
    ("logprobs.py", "to_host", "chosen.tolist()"): (HOST, "read back above"),
    ("logprobs.py", "ParticleLogprobs.write", "sampling.to_host(*scored)"): (
        HOST,
        "the decoder read the scores back with its round",
    ),
    ("smc.py", "SMCDecoder._round", "pop.live.tolist()"): (HOST, "Population lives on the host"),
    ("smc.py", "SMCDecoder._particles", "weights.tolist()"): (HOST, "Population's weights"),
    ("smc.py", "SMCDecoder._particles", "int(pop.lengths[choice])"): (HOST, "Population's"),
    ("smc.py", "SMCDecoder._draw_answer", "bool(weights.sum() > 0)"): (HOST, "final weights"),
    (
        "smc.py",
        "SMCDecoder._draw_answer",
        "int(torch.multinomial(weights, 1, generator=generator))",
    ): (HOST, "final weights"),
    ("smc_guide.py", "PotentialGuide.report", "int((~torch.isneginf(pop.log_w)).sum())"): (
        HOST,
        "Population's weights",
    ),
    (
        "autoregressive.py",
        "AutoregressiveDecoder._decode",
        "bool(new and new[-1] in self.target.eos_token_ids and sampling_cfg.stop_at_eos)",
    ): (HOST, "Python values"),
}
# (file, function, call) -> why a copy without non_blocking is not one from the host
COPIES = {
    ("sampling.py", "_invert_chunked", "p[:, :v].copy_(rows)"): "rows and p share logp's device",
}
ROUND_FUNCTIONS = {
    ("smc.py", "SMCDecoder._round"),
    ("speculative.py", "SpeculativeDecoder._accept"),
    ("autoregressive.py", "AutoregressiveDecoder.draw"),
    ("msd.py", "MultiDraftDecoder.round"),
}
DTYPES = {"float64", "float32", "float16", "bfloat16", "double", "float", "half", "long", "int"}
DTYPES |= {"int64", "int32", "bool", "uint8"}


def calls(tree: ast.AST) -> list[tuple[str, ast.Call]]:
    """Every call in tree with the dotted name of the functions and classes around it."""
    found: list[tuple[str, ast.Call]] = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = (*scope, child.name)
            if isinstance(child, ast.Call):
                found.append((".".join(inner), child))
            visit(child, inner)

    visit(tree, ())
    return found


def is_read(call: ast.Call) -> bool:
    """A call that needs a tensor's value on the host (if the tensor is on a device)."""
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr in {"cpu", "item", "tolist", "numpy"}:
        return not call.args
    if isinstance(f, ast.Attribute) and f.attr == "to_host":
        return True
    if isinstance(f, ast.Name) and f.id in {"int", "float", "bool"} and len(call.args) == 1:
        return not isinstance(call.args[0], ast.Constant)
    return False


def is_dtype(node: ast.expr) -> bool:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return (node.value.id == "torch" and node.attr in DTYPES) or node.attr.endswith("dtype")
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name.endswith("dtype")


def is_blocking_copy(call: ast.Call) -> bool:
    """`.to(<not only a dtype>)`, `.cuda()` or `.copy_()` without non_blocking=True."""
    f = call.func
    if not isinstance(f, ast.Attribute) or f.attr not in {"to", "cuda", "copy_"}:
        return False
    for kw in call.keywords:
        if kw.arg == "non_blocking" and isinstance(kw.value, ast.Constant) and kw.value.value:
            return False
    if f.attr == "to":
        kw_names = {kw.arg for kw in call.keywords}
        only_dtype = all(is_dtype(a) for a in call.args) and "device" not in kw_names
        return not (only_dtype and (call.args or "dtype" in kw_names))
    return True


def violations(name: str, source: str) -> tuple[list[str], list[tuple[str, str, str]]]:
    """(the unlisted reads and blocking copies of one module's source, the listed ones seen)."""
    bad: list[str] = []
    seen: list[tuple[str, str, str]] = []
    if name in HOST_MODULES:
        return bad, seen
    for scope, call in calls(ast.parse(source)):
        key = (name, scope, ast.unparse(call))
        if is_read(call):
            seen.append(key)
            if key not in READS:
                bad.append(f"{name}:{call.lineno} {scope}: read {key[2]} is not listed")
        elif is_blocking_copy(call):
            seen.append(key)
            if key not in COPIES:
                bad.append(f"{name}:{call.lineno} {scope}: {key[2]} copies without non_blocking")
    return bad, seen


def scan() -> tuple[list[str], set[tuple[str, str, str]]]:
    bad: list[str] = []
    seen: set[tuple[str, str, str]] = set()
    for path in SOURCES:
        b, s = violations(path.name, path.read_text())
        bad += b
        seen |= set(s)
    return bad, seen


def test_no_blocking_copy_and_no_unlisted_read_in_the_decoders():
    bad, _ = scan()
    assert not bad, "\n".join(bad)


def test_every_listed_call_still_exists():
    """A stale entry would let a new call of the same text through unexamined."""
    _, seen = scan()
    assert set(READS) | set(COPIES) <= seen, (set(READS) | set(COPIES)) - seen


def test_each_round_has_one_listed_wait():
    rounds = [(f, fn) for (f, fn, _), (kind, _) in READS.items() if kind == ROUND]
    assert sorted(rounds) == sorted(ROUND_FUNCTIONS)


ROUND_BEFORE = """
class SMCDecoder:
    def _round(self):
        feed = torch.cat([pending(seqs, t_cache).to(drafts.device), drafts], dim=1)
        logits = logits.to(torch.float32)
        x = x.to(dtype=torch.float32)
        drafts, bonus, log_ratio = drafts.cpu(), bonus.cpu(), log_ratio.cpu()
        k = int(n.sum())
        w = sampling.to_host(drafts, bonus, log_ratio, agree, *(scored or ()))
"""


def test_the_scan_rejects_the_round_as_it_was():
    """smc.py's round before this check: a blocking copy before the verify pass and three
    reads; dtype conversions and the listed read pass."""
    bad, _ = violations("smc.py", ROUND_BEFORE)
    assert len(bad) == 5, bad
    assert "copies without non_blocking" in bad[0] and "pending(seqs, t_cache)" in bad[0]
    assert all("read" in b for b in bad[1:]), bad
    assert violations("population.py", ROUND_BEFORE) == ([], [])


# -- the behaviour, on the meta device ------------------------------------------------------

aten = torch.ops.aten


class DeviceTraffic(TorchDispatchMode):
    """Counts the host's waits for the meta device (a copy of a meta tensor to the host, its
    value in Python) and the host -> meta copies that do not say non_blocking. What is read
    back is zeros: the decoders' host bookkeeping runs on, with every token 0."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0
        self.blocking: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if src is not None and src.is_meta:
            if func in (aten._local_scalar_dense.default, aten.equal.default):
                self.waits += 1
                return False if src.dtype == torch.bool else 0
            to = copy_target(func, args, kwargs)
            if to is not None and to.type == "cpu":
                self.waits += 1
                dtype = by_name(func, args, kwargs).get("dtype") or src.dtype
                return torch.zeros(src.shape, dtype=dtype)
        if blocking_upload(func, args, kwargs):
            self.blocking.append(f"{func}{tuple(args[0].shape)}")
        return func(*args, **kwargs)


def by_name(func, args, kwargs) -> dict:
    """The call's arguments by their names in the op's schema."""
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def copy_target(func, args, kwargs) -> torch.device | None:
    """The device a `.to` copies to (None: not a copy, or not to another device). Decoding in
    inference mode dispatches `aten.to` itself, autograd's `aten._to_copy` otherwise."""
    if func.overloadpacket not in (aten._to_copy, aten.to):
        return None
    named = by_name(func, args, kwargs)
    to = named.get("device") or getattr(named.get("other"), "device", None)
    return None if to is None else torch.device(to)


def blocking_upload(func, args, kwargs) -> bool:
    """A host -> meta copy (`.to` or `copy_`) that does not say non_blocking."""
    to = copy_target(func, args, kwargs)
    if to is not None and not args[0].is_meta:
        return to.type == "meta" and not by_name(func, args, kwargs).get("non_blocking")
    if func is aten.copy_.default and args[0].is_meta and not args[1].is_meta:
        return not kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    return False


class MetaCache:
    def __init__(self) -> None:
        self.batch_size, self.length = 1, 0

    def select(self, rows: torch.Tensor) -> None:
        self.batch_size = rows.numel()

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def release(self) -> None:
        self.length = 0


class MetaLM:
    """A `CausalLM` whose logits live on the meta device. `marks`: the host's waits so far at
    each call, so that the waits between two target passes are one round's."""

    vocab_size = 32
    eos_token_ids = frozenset({31})  # never read back: every value read is 0
    context_length = None

    def __init__(self, traffic: DeviceTraffic) -> None:
        self.traffic = traffic
        self.marks: list[int] = []

    def new_cache(self) -> MetaCache:
        return MetaCache()

    def forward(self, tokens: torch.Tensor, cache: MetaCache, num_logits: int) -> torch.Tensor:
        self.marks.append(self.traffic.waits)
        cache.batch_size, cache.length = tokens.shape[0], cache.length + tokens.shape[1]
        return torch.zeros(tokens.shape[0], num_logits, self.vocab_size, device="meta")


def waits_per_round(method: str, cfg: SamplingConfig) -> tuple[list[int], list[str]]:
    """The host's waits between the prefill and the first round, then in each round (from one
    target pass to the next), and the blocking host -> device copies of a whole decode."""
    traffic = DeviceTraffic()
    target, draft = MetaLM(traffic), MetaLM(traffic)
    decoder = {
        "ar": lambda: AutoregressiveDecoder(target),
        "sd": lambda: SpeculativeDecoder(target, draft, SDConfig(3)),
        "smc": lambda: SMCDecoder(target, draft, SMCConfig(particles=4, draft_tokens=3)),
        "msd": lambda: MultiDraftDecoder(target, draft, MSDConfig(particles=4, draft_tokens=3)),
    }[method]()
    with traffic:
        decoder.decode([1, 2, 3], cfg, torch.Generator().manual_seed(0))
    marks = [*target.marks, traffic.waits]
    return [b - a for a, b in itertools.pairwise(marks)], traffic.blocking


PLAIN = SamplingConfig(1.0, max_new_tokens=9)
ADJUSTED = SamplingConfig(
    0.8,
    top_k=8,
    top_p=0.9,
    max_new_tokens=9,
    repetition_penalty=1.2,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    logit_bias={4: 2.0},
)
LOGPROBS = SamplingConfig(1.0, max_new_tokens=9, logprobs=2)
# rounds of 9 new tokens: ar one each; sd one each (every read-back draft is "rejected");
# smc K + 1 = 4, 4, then 1; msd one each (depth 0 read back: the walk rejected at the root)
ROUNDS = {"ar": 9, "sd": 9, "smc": 3, "msd": 9}


@pytest.mark.parametrize("cfg", [PLAIN, ADJUSTED, LOGPROBS], ids=["plain", "adjusted", "logprobs"])
@pytest.mark.parametrize("method", ["ar", "sd", "smc", "msd"])
def test_one_wait_per_round_and_no_blocking_copy(method, cfg):
    per_round, blocking = waits_per_round(method, cfg)
    # sd's logprobs are read once the block is known: a second wait (see READS)
    waits = 2 if method == "sd" and cfg.logprobs is not None else 1
    assert per_round == [0] + [waits] * ROUNDS[method]
    assert blocking == []
