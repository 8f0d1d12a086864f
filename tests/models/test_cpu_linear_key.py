"""The kernel's build key, field by field: its source, the compile flags, torch's version, the
machine, Python's version and this CPU's instruction sets each change it (a build made under
another is not loaded: the module's name carries the key); nothing else does."""

import pytest

from smcspec.models import cpu_linear


class _CPUInfo:
    """/proc/cpuinfo with other flags (or, raising, none to read)."""

    def __init__(self, flags):
        self.flags = flags

    def read_text(self):
        if self.flags is None:
            raise OSError("no /proc")
        return f"processor\t: 0\nflags\t\t: {self.flags}\nbogomips\t: 1\n"


def _cpuinfo(flags):
    real = cpu_linear.Path

    def change(monkeypatch, tmp_path):
        fake = lambda p: _CPUInfo(flags) if str(p) == "/proc/cpuinfo" else real(p)  # noqa: E731
        monkeypatch.setattr(cpu_linear, "Path", fake)

    return change


def _sources(edit: bool, which: int = 0):
    """Each source copied elsewhere (the key hashes bytes, not paths), source `which` with a
    line added where `edit`."""

    def change(monkeypatch, tmp_path):
        copies = []
        for i, source in enumerate(cpu_linear._SOURCES):
            copy = tmp_path / source.name
            copy.write_bytes(
                source.read_bytes() + (b"\n// another\n" if edit and i == which else b"")
            )
            copies.append(copy)
        monkeypatch.setattr(cpu_linear, "_SOURCES", tuple(copies))

    return change


def _attr(target, name, value):
    def change(monkeypatch, tmp_path):
        monkeypatch.setattr(target, name, value)

    return change


# each change, and whether the key must change with it
KEY_CHANGES = {
    "the products' source": (_sources(True, 0), True),
    "the attention's source": (_sources(True, 1), True),
    "flags": (_attr(cpu_linear, "_FLAGS", [*cpu_linear._FLAGS, "-DMORE"]), True),
    "torch": (_attr(cpu_linear.torch, "__version__", "0.0.1"), True),
    "machine": (_attr(cpu_linear.platform, "machine", lambda: "riscv64"), True),
    "python": (_attr(cpu_linear.sys, "version_info", (3, 99, 0)), True),
    "cpu flags": (_cpuinfo("fpu sse2 avx512_vnni_other"), True),
    # nothing else: where the source lies, the CPU's other lines of /proc/cpuinfo
    "the sources' paths": (_sources(False), False),
    "the environment": (_attr(cpu_linear.os, "environ", {"OMP_NUM_THREADS": "3"}), False),
}


@pytest.mark.parametrize("change", list(KEY_CHANGES))
def test_the_build_key_changes_with_each_field_it_names_and_nothing_else(
    change, monkeypatch, tmp_path
):
    apply, keyed = KEY_CHANGES[change]
    key = cpu_linear.build_key()
    assert cpu_linear.build_key() == key
    apply(monkeypatch, tmp_path)
    other = cpu_linear.build_key()
    monkeypatch.undo()
    assert (other != key) == keyed
