"""Real training data for probes: a text file, tokenised and packed inside the DataLoader workers.

Synthetic token batches (the default) cost nothing to produce, so with them
``dataloader_num_workers`` can never matter. With ``--dataset`` the probe reads a real file and
does what a real fine-tune does per sample: tokenise, then pack to ``seq_len`` tokens. That work
runs in :class:`TextDataset.__getitem__`, so with workers it happens in the worker processes, and
pinned memory and prefetching follow the ``TrainingArguments`` under test.

Formats, by extension: ``.jsonl``/``.json`` (one object per line), ``.csv``, ``.parquet`` (needs
pyarrow), ``.txt`` (one document per non-empty line; no column). Everything the user gives is
checked by :func:`validate_dataset` in the parent, before any study exists.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from autotune.errors import UsageError

FORMATS: dict[str, str] = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
DEFAULT_TEXT_COLUMN = "text"


@dataclass(frozen=True)
class DatasetSpec:
    """A text dataset and the tokenizer to read it with; crosses the process boundary as a dict."""

    path: str
    tokenizer: str  # a local directory or a hub id (read from the local cache when offline)
    text_column: str = DEFAULT_TEXT_COLUMN  # ignored for .txt

    @property
    def format(self) -> str:
        return FORMATS[Path(self.path).suffix.lower()]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DatasetSpec:
        return cls(**data)


def read_texts(path: str | Path, text_column: str = DEFAULT_TEXT_COLUMN) -> list[str]:
    """The documents of a dataset file, in file order (empty ones dropped).

    Raises:
        UsageError: missing file, unknown extension, missing column, or no text at all.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--dataset {path} does not exist: give a .jsonl, .csv, .parquet or .txt file")
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise UsageError(
            f"--dataset {path} has an unknown extension {path.suffix!r}: use one of {', '.join(sorted(FORMATS))}"
        )
    if kind == "text":
        texts = [line.strip() for line in _read_text(path).splitlines()]
    elif kind == "jsonl":
        texts = _column(_jsonl_rows(path), text_column, path)
    elif kind == "csv":
        reader = csv.DictReader(io.StringIO(_read_text(path), newline=""))
        try:
            if text_column not in (reader.fieldnames or []):
                raise _missing_column(path, text_column, reader.fieldnames or [])
            texts = [row[text_column] or "" for row in reader]
        except csv.Error as exc:  # a field over the csv module's limit, an unclosed quote at the end...
            raise UsageError(f"--dataset {path} line {reader.line_num} is not CSV ({exc}): give a CSV file with a header row") from None
    else:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UsageError(f"--dataset {path} is Parquet, which needs pyarrow: pip install pyarrow") from None
        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as exc:  # pyarrow.ArrowInvalid is a ValueError: not Parquet, or a damaged file
            first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            raise UsageError(f"--dataset {path} is not a readable Parquet file ({first}): give a Parquet file, or a .jsonl/.csv/.txt one") from None
        if text_column not in table.column_names:
            raise _missing_column(path, text_column, table.column_names)
        texts = [str(value) if value is not None else "" for value in table.column(text_column).to_pylist()]
    texts = [text for text in texts if text and text.strip()]
    if not texts:
        raise UsageError(f"--dataset {path} has no text in column {text_column!r}: check --text-column")
    return texts


_SNIFF_BYTES = 1 << 16  # a NUL byte in the first 64 KiB: a binary file, whatever its extension says


def _read_text(path: Path) -> str:
    """The file as text (UTF-8, a byte-order mark dropped).

    Raises:
        UsageError: for a binary file (NUL bytes: an archive, a model, UTF-16 text) or one that is not UTF-8.
    """
    data = path.read_bytes()
    fix = f"give a UTF-8 text file ({', '.join(sorted(k for k, v in FORMATS.items() if v != 'parquet'))}), or re-save it as UTF-8"
    if b"\x00" in data[:_SNIFF_BYTES]:
        raise UsageError(f"--dataset {path} is a binary file, not text (it holds NUL bytes): {fix}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise UsageError(f"--dataset {path} is not UTF-8 text (line {line}, byte {exc.start}: {exc.reason}): {fix}") from None


def _jsonl_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--dataset {path} line {number} is not JSON ({exc.msg}): give one JSON object per line") from None
        if not isinstance(row, dict):
            raise UsageError(f"--dataset {path} line {number} is not a JSON object: give one object per line")
        rows.append(row)
    return rows


def _column(rows: list[dict[str, Any]], column: str, path: Path) -> list[str]:
    if rows and column not in rows[0]:
        raise _missing_column(path, column, list(rows[0]))
    return [str(row.get(column) or "") for row in rows]


def _missing_column(path: Path, column: str, available: list[str]) -> UsageError:
    return UsageError(
        f"--dataset {path} has no column {column!r}: pass --text-column with one of {', '.join(available) or '(none)'}"
    )


def load_tokenizer(name_or_path: str) -> Any:
    """``AutoTokenizer`` for a local directory or a hub id (offline: from the local cache).

    Raises:
        UsageError: if it cannot be loaded.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, HF hub errors...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"cannot load tokenizer {name_or_path!r} ({first[:160]}): pass --tokenizer with a local tokenizer directory"
        ) from None


def validate_dataset(spec: DatasetSpec, vocab_size: int) -> int:
    """Check the file, the column and the tokenizer in the parent; return the number of documents.

    Raises:
        UsageError: for anything that would make every probe fail.
    """
    texts = read_texts(spec.path, spec.text_column)
    tokenizer = load_tokenizer(spec.tokenizer)
    if len(tokenizer) > vocab_size:
        raise UsageError(
            f"tokenizer {spec.tokenizer!r} has {len(tokenizer)} tokens but the model's vocabulary has {vocab_size}: "
            "pass the model's own --tokenizer"
        )
    known = known_token_fraction(tokenizer, texts[:SAMPLE_DOCUMENTS])
    if known < MIN_KNOWN_TOKEN_FRACTION:
        raise UsageError(
            f"tokenizer {spec.tokenizer!r} cannot encode this data ({100 * known:.0f}% of its tokens are known; "
            f"{len(tokenizer)} tokens in its vocabulary): pass --tokenizer with the model's own tokenizer"
        )
    return len(texts)


# A directory with a config but no tokenizer files loads as an empty tokenizer in transformers 5
# that turns every document into unknown tokens; a real tokenizer leaves almost none unknown.
MIN_KNOWN_TOKEN_FRACTION = 0.5
SAMPLE_DOCUMENTS = 50  # enough text to judge, little enough to check in the parent in milliseconds


def known_token_fraction(tokenizer: Any, texts: list[str]) -> float:
    """The share of tokens of ``texts`` that are neither the unknown token nor missing: 0 when the
    texts make no token at all (a tokenizer that encodes text to nothing cannot train on it)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    total = known = 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        total += max(len(ids), 1)  # a non-empty document that encodes to nothing counts as one unknown
        known += sum(1 for i in ids if i is not None and i != unk and i not in special)
    return known / total if total else 0.0


class TextDataset:
    """Map-style dataset: sample ``i`` is ``seq_len`` tokens packed from documents ``i, i+1, ...``.

    Tokenisation happens in ``__getitem__`` (so in the DataLoader workers); the tokenizer is loaded
    lazily, once per process. Documents are joined with the EOS token and wrap around the file, so
    every sample is exactly ``seq_len`` real tokens (no padding: tokens/s counts real tokens).
    """

    def __init__(self, spec: DatasetSpec, seq_len: int, length: int) -> None:
        self.spec, self.seq_len, self.length = spec, seq_len, length
        self.texts = read_texts(spec.path, spec.text_column)
        self._tokenizer: Any = None

    def __len__(self) -> int:
        return self.length

    def _tokenize(self, text: str) -> list[int]:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.spec.tokenizer)
        ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        eos = self._tokenizer.eos_token_id
        return [*ids, eos] if eos is not None else ids

    def __getitem__(self, index: int) -> dict[str, Any]:
        import torch

        tokens: list[int] = []
        doc = index % len(self.texts)
        for _ in range(self.seq_len + len(self.texts)):  # bound: a file of empty tokenisations
            tokens.extend(self._tokenize(self.texts[doc]))
            if len(tokens) >= self.seq_len:
                break
            doc = (doc + 1) % len(self.texts)
        if len(tokens) < self.seq_len:
            raise ValueError(f"{self.spec.path}: the tokenizer produced no tokens for any document")
        ids = torch.tensor(tokens[: self.seq_len], dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}
