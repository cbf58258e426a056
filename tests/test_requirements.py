"""requirements*.txt state ranges, constraints.txt pins one point inside them, the launcher checks ranges."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT

import launch_parallel_training as launcher
from common.launcher import dependencies


def entries(name: str) -> dict[str, str]:
    out = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            match = re.match(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(.*)", line)
            out[match.group(1).lower()] = match.group(3)
    return out


def test_every_pin_lies_inside_its_range_and_every_range_is_pinned():
    pins = entries("constraints.txt")
    for name in ("requirements.txt", "requirements-extras.txt", "requirements-test.txt", "requirements-tracking.txt"):
        for package, spec in entries(name).items():
            assert spec and not spec.startswith("=="), f"{name}: {package} is pinned, not a range"
            assert package in pins, f"{package} has no exact version in constraints.txt"
            assert dependencies.satisfies(pins[package][2:], spec), (package, pins[package], spec)


def test_test_only_packages_are_not_runtime_requirements():
    runtime = entries("requirements.txt")
    assert not {"pytest", "pytest-timeout", "pytest-xdist"} & set(runtime)
    assert {"pytest", "pytest-timeout", "pytest-xdist"} <= set(entries("requirements-test.txt"))


# torch's floor is the version the tests ran on (requirements.txt says why): older torch is refused.
@pytest.mark.parametrize("version, ok", [("2.13.0", True), ("2.13.1+cu126", True),
                                         ("2.14.0a0+5228986c39.nv25.05", True), ("2.12.0", False), ("2.4.0", False),
                                         ("3.0.0", False)])
def test_the_launcher_accepts_any_torch_build_inside_the_range(version, ok):
    assert dependencies.satisfies(version, entries("requirements.txt")["torch"]) is ok


def test_the_torch_floor_is_the_tested_version():
    tested = entries("constraints.txt")["torch"][2:]
    floor = re.search(r">=\s*([\d.]+)", entries("requirements.txt")["torch"]).group(1)
    assert tested.split(".")[:2] == floor.split(".")[:2], (tested, floor)


@pytest.mark.parametrize("torch_version, accepted", [("2.13.1+cu126", True), ("2.14.0a0+5228986c39.nv25.05", True),
                                                     ("2.12.0+cu126", False)])
def test_the_launcher_runs_on_any_torch_inside_the_range_and_says_what_was_tested(monkeypatch, capsys,
                                                                                 torch_version, accepted):
    real = dependencies.importlib.metadata.version
    monkeypatch.setattr(dependencies.importlib.metadata, "version",
                        lambda name: torch_version if name == "torch" else real(name))
    assert launcher.main(["--check-only"]) == (0 if accepted else 1)
    out = capsys.readouterr().out
    tested = entries("constraints.txt")["torch"][2:]
    assert f"torch           {torch_version}" in out and f"tested with {tested}" in out
    assert ("missing or wrong version: torch" in out) is not accepted
