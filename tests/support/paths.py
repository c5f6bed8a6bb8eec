"""Paths the tests use: the repository, the tests folder and the oracle fixtures."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
#: the Hugging Face fixtures (tests/fixtures/hf/<case>)
HF = FIXTURES / "hf"
#: the Tutel oracle cases (tests/fixtures/tutel/<case>)
TUTEL = FIXTURES / "tutel"
