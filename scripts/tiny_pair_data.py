"""Data for the tiny code pair: Python sources found on the machine, a byte-level BPE tokenizer,
token streams and held-out evaluation prompts.

Used by ``scripts/train_tiny_pair.py``. Nothing here needs a GPU.

The corpus is the standard library of the running interpreter
(``sysconfig.get_paths()['stdlib']``), without ``site-packages`` / ``dist-packages`` so that the
corpus does not depend on what else is installed. A file is held out for evaluation when the
SHA-1 of its path relative to the stdlib root falls in a fixed residue class, so the split is the
same on every machine that has the same Python version, and stable under files being added.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import sysconfig
from dataclasses import dataclass
from typing import Iterable, List, Sequence

import numpy as np

EOT_TOKEN = "<|endoftext|>"  # id 0: separates files in the stream; the target's eos
MASK_TOKEN = "<|MASK|>"  # id 1: DFlash's mask token (SGLang's default mask_token string)
SPECIAL_TOKENS = [EOT_TOKEN, MASK_TOKEN]
EOT_ID = 0
MASK_ID = 1

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
MAX_FILE_BYTES = 400_000  # a few generated test-data files are huge and repetitive


@dataclass
class SourceFile:
    relpath: str  # path relative to the stdlib root, '/'-separated
    text: str


@dataclass
class Corpus:
    root: str
    train: List[SourceFile]
    eval: List[SourceFile]

    @property
    def train_bytes(self) -> int:
        return sum(len(f.text.encode("utf-8")) for f in self.train)

    @property
    def eval_bytes(self) -> int:
        return sum(len(f.text.encode("utf-8")) for f in self.eval)


def is_held_out(relpath: str, eval_modulus: int) -> bool:
    """True for the deterministic evaluation share (about 1/eval_modulus of the files)."""
    digest = hashlib.sha1(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % eval_modulus == 0


def collect_stdlib_sources(
    root: str | None = None, eval_modulus: int = 40, max_train_files: int | None = None
) -> Corpus:
    """Read every ``*.py`` under the stdlib root and split it into train / eval files.

    Parameters
    ----------
    root : str, optional
        Directory to scan; defaults to the running interpreter's stdlib.
    eval_modulus : int
        About one file in ``eval_modulus`` is held out (see :func:`is_held_out`).
    max_train_files : int, optional
        Keep only the first N training files in path order (smoke runs).
    """
    root_path = pathlib.Path(root or sysconfig.get_paths()["stdlib"]).resolve()
    if not root_path.is_dir():
        raise FileNotFoundError(f"source root {root_path} is not a directory")
    train: List[SourceFile] = []
    held: List[SourceFile] = []
    for path in sorted(root_path.rglob("*.py")):
        rel = path.relative_to(root_path)
        if _SKIP_DIRS.intersection(rel.parts) or not path.is_file():
            continue
        raw = path.read_bytes()
        if not raw.strip() or len(raw) > MAX_FILE_BYTES:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a few test fixtures are deliberately in other encodings
        item = SourceFile(rel.as_posix(), text)
        (held if is_held_out(item.relpath, eval_modulus) else train).append(item)
    if max_train_files is not None:
        train = train[:max_train_files]
        held = held[: max(2, max_train_files // 10)]
    if not train or not held:
        raise RuntimeError(
            f"corpus under {root_path} too small: {len(train)} train and {len(held)} eval files"
        )
    return Corpus(str(root_path), train, held)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE tokenizer (GPT-2 style pre-tokenizer, no prefix space).

    Special tokens come first, so ``<|endoftext|>`` is id 0 and ``<|MASK|>`` id 1.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for idx, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != idx:
            raise RuntimeError(f"special token {name!r} got id {tok.token_to_id(name)}, expected {idx}")
    return tok


def save_tokenizer(tok, out_dir: pathlib.Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` that AutoTokenizer understands."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT_TOKEN,
        "eos_token": EOT_TOKEN,
        "pad_token": EOT_TOKEN,
        "mask_token": MASK_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    special = {"bos_token": EOT_TOKEN, "eos_token": EOT_TOKEN, "pad_token": EOT_TOKEN,
               "mask_token": MASK_TOKEN}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def encode_stream(tok, files: Sequence[SourceFile]) -> np.ndarray:
    """Concatenate the files' token ids, each file followed by ``<|endoftext|>``.

    Returns
    -------
    np.ndarray
        int32 array ``[total_tokens]``.
    """
    encodings = tok.encode_batch([f.text for f in files])
    parts = []
    for enc in encodings:
        parts.append(np.asarray(enc.ids, dtype=np.int32))
        parts.append(np.asarray([EOT_ID], dtype=np.int32))
    return np.concatenate(parts)


def make_eval_prompts(
    tok, files: Sequence[SourceFile], num_prompts: int, prompt_tokens: int,
    per_file: int | None = None,
) -> List[dict]:
    """Cut prompts of about ``prompt_tokens`` tokens out of held-out files, at line boundaries.

    Each prompt starts at one of ``per_file`` evenly spaced line offsets of its file (default:
    enough offsets for ``num_prompts`` with room for files too short to give them all) and takes
    whole lines until it has at least ``prompt_tokens`` tokens (an offset inside the previous
    prompt of the same file is skipped, so prompts never overlap); prompts whose lines run past
    1.5x that length are skipped, so every prompt has between 1x and 1.5x ``prompt_tokens``.
    Files are visited round-robin (first prompt of each file, then the second, ...) so that the
    first N prompts cover as many files as possible. ``input_ids`` is exactly
    ``tok.encode(text).ids``.
    """
    if per_file is None:
        per_file = max(4, -(-2 * num_prompts // max(len(files), 1)))
    candidates: List[List[dict]] = []
    for f in files:
        lines = f.text.splitlines(keepends=True)
        found, free_from = [], 0  # prompts of one file never overlap
        for k in range(per_file):
            start = (k * len(lines)) // per_file
            if start < free_from:
                continue
            text, n_tok, used = "", 0, 0
            for line in lines[start:]:
                text += line
                used += 1
                n_tok = len(tok.encode(text).ids)
                if n_tok >= prompt_tokens:
                    break
            if prompt_tokens <= n_tok <= int(1.5 * prompt_tokens) and text.strip():
                found.append({"source": f.relpath, "start_line": start, "text": text,
                              "input_ids": tok.encode(text).ids})
                free_from = start + used
        candidates.append(found)
    prompts: List[dict] = []
    for k in range(per_file):
        for found in candidates:
            if k < len(found) and len(prompts) < num_prompts:
                prompts.append(found[k])
    for i, p in enumerate(prompts):
        p["id"] = i
    return prompts


def write_jsonl(path: pathlib.Path, rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
