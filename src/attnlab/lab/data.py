"""Data sources of the lab. Each one's ``batch(step, rank, world, split)`` is a pure function of
its seed and those arguments, so a resumed run needs no data-loader state: only the step.

Shapes: B = batch_size // world rows per rank, T = the source's ``block_size``. Every source
returns ``x`` and ``y`` int64 ``(B, T)`` with ``y`` the next token of ``x``; positions where the
next token is unpredictable by construction carry ``IGNORE`` (-100, cross-entropy's
``ignore_index``), so loss and accuracy count only the positions that matter.

* :class:`CharDataset`: seed 002 section 3.1, faithful (random ids, ``x = seq[:-1]``, ``y = seq[1:]``).
* :class:`RandomTask`: batches drawn from a ``CharDataset`` pool; the held-out split is a second pool.
* :class:`RecallTask`: associative recall, ``a3c7e1|c7a3c7``: after ``|`` each queried key is followed by its value.
* :class:`CopyTask`: ``kxqb|kxqb``: after ``|`` the sequence is repeated.
* :class:`TextCharDataset`: windows of a UTF-8 file, characters as tokens.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from ..runtime import UsageError
from ..weight_files.tokenizer import CharTokenizer
from .config import DataConfig

__all__ = [
    "IGNORE",
    "CharDataset",
    "RandomTask",
    "RecallTask",
    "CopyTask",
    "TextCharDataset",
    "build_task",
    "length_flag",
    "sequence_length",
]

IGNORE = -100  # F.cross_entropy's default ignore_index
KEYS = "abcdefghijklmnopqrstuvwxyz"
VALUES = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
PRINTABLE = "".join(chr(c) for c in range(33, 127))  # 94 visible ASCII characters, to show random ids as text
SEP = "|"


def sequence_length(cfg: DataConfig) -> int:
    """``T``, the tokens of one ``x`` (the source's ``block_size``), from the config alone: what flags are
    checked against before any work (:func:`attnlab.lab.validation.validate_lengths`)."""
    if cfg.task == "copy":
        return 2 * cfg.copy_len  # L symbols, "|", L symbols, minus one for the shift
    if cfg.task == "recall":
        return 4 * cfg.n_pairs  # 2n context + "|" + 2n queries, minus one for the shift
    return cfg.seq_len  # random, text


def length_flag(cfg: DataConfig, prefix: str = "--data.") -> tuple[str, int]:
    """The flag that sets :func:`sequence_length` for ``cfg.task``, and its value: ``("--data.copy-len", 12)``."""
    name = {"copy": "copy_len", "recall": "n_pairs"}.get(cfg.task, "seq_len")
    return prefix + name.replace("_", "-"), getattr(cfg, name)


def stream_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed for (seed, parts...): distinct streams for distinct splits, steps and ranks."""
    digest = hashlib.sha256("/".join(map(str, (seed, *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def generator(seed: int, *parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(stream_seed(seed, *parts))


def shard(x: Tensor, y: Tensor, rank: int, world: int) -> tuple[Tensor, Tensor]:
    """Rows ``[rank * B/world, (rank + 1) * B/world)`` of a global batch: ranks see disjoint rows,
    and the union over ranks is exactly the single-process batch."""
    B = x.size(0)
    if world < 1 or not 0 <= rank < world or B % world:
        raise ValueError(
            f"batch_size={B} must be divisible by world={world} with 0 <= rank={rank} < world; "
            f"pick a batch size that is a multiple of the number of processes."
        )
    n = B // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]  # (B/world, T) each


class CharDataset(Dataset):
    """Seed 002's dataset: ``num_samples`` random sequences of ``seq_len + 1`` ids, drawn once.

    ``dataset[i]`` is ``(x, y)`` with ``x = seq[:-1]``, ``y = seq[1:]``, both ``(seq_len,)``. The ids
    are independent and uniform, so no model can predict ``y`` better than chance: the
    cross-entropy floor is ``ln(vocab_size)``. (Only ``seed`` is new: the seed draws from torch's
    global RNG.)
    """

    def __init__(self, seq_len: int, num_samples: int, vocab_size: int, seed: int = 0) -> None:
        self.seq_len = seq_len
        self.num_samples = num_samples
        self.vocab_size = vocab_size
        self.data = torch.randint(0, vocab_size, (num_samples, seq_len + 1), generator=generator(seed, "chardataset"))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx):
        x = self.data[idx, :-1]
        y = self.data[idx, 1:]
        return x, y


class RandomTask:
    """Seed 002's experiment as a lab task: each step reads ``batch_size`` rows of a :class:`CharDataset`
    in the order of a per-epoch permutation; the held-out split is another pool from a disjoint seed."""

    def __init__(self, cfg: DataConfig) -> None:
        if not 2 <= cfg.vocab_size:
            raise UsageError(f"--data.vocab-size must be >= 2, got {cfg.vocab_size}; pass e.g. --data.vocab-size 16.")
        self.cfg = cfg
        self.train_pool = CharDataset(cfg.seq_len, cfg.num_samples, cfg.vocab_size, seed=stream_seed(cfg.seed, "train"))
        self.eval_pool = CharDataset(
            cfg.seq_len, max(cfg.batch_size * 16, 1024), cfg.vocab_size, seed=stream_seed(cfg.seed, "eval")
        )
        chars = PRINTABLE[: cfg.vocab_size] if cfg.vocab_size <= len(PRINTABLE) else None
        self.tokenizer = CharTokenizer(chars) if chars else None
        self.vocab_size = cfg.vocab_size
        self.block_size = sequence_length(cfg)
        self.chance_acc = 1.0 / cfg.vocab_size
        self.loss_floor = math.log(cfg.vocab_size)  # entropy of a uniform next id: nothing can do better

    def batch(self, step: int, rank: int = 0, world: int = 1, split: str = "train") -> tuple[Tensor, Tensor]:
        pool = self.train_pool if split == "train" else self.eval_pool
        B, N = self.cfg.batch_size, len(pool)
        perms: dict[int, Tensor] = {}  # epoch -> its shuffle, as a DataLoader(shuffle=True) would draw
        rows = []
        for i in range(step * B, (step + 1) * B):  # i counts samples since the start: epoch i // N, slot i % N
            if i // N not in perms:
                perms[i // N] = torch.randperm(N, generator=generator(self.cfg.seed, split, "epoch", i // N))
            rows.append(int(perms[i // N][i % N]))
        x, y = pool[torch.tensor(rows)]  # (B, T) each
        return shard(x, y, rank, world)


class RecallTask:
    """Associative recall: ``n_pairs`` key-value pairs, ``|``, then ``n_pairs`` queries (keys drawn
    from the pairs, with replacement), each followed by its value. Only the value after a query key is scored: it is predictable solely by
    finding that key earlier in the sequence and reading the token after it, which needs attention."""

    def __init__(self, cfg: DataConfig) -> None:
        if not 1 <= cfg.n_pairs <= cfg.n_keys <= len(KEYS) or not 2 <= cfg.n_values <= len(VALUES):
            raise UsageError(
                f"recall needs 1 <= n_pairs <= n_keys <= {len(KEYS)} and 2 <= n_values <= {len(VALUES)}, got "
                f"n_pairs={cfg.n_pairs}, n_keys={cfg.n_keys}, n_values={cfg.n_values}; change --data.n-pairs/n-keys/n-values."
            )
        self.cfg = cfg
        self.tokenizer = CharTokenizer(KEYS[: cfg.n_keys] + VALUES[: cfg.n_values] + SEP)
        self.vocab_size = self.tokenizer.vocab_size
        self.block_size = sequence_length(cfg)  # 4n
        self.chance_acc = 1.0 / cfg.n_values

    def sequences(self, g: torch.Generator, B: int) -> Tensor:
        """``(B, 4 n + 1)`` token ids of whole sequences."""
        n, K = self.cfg.n_pairs, self.cfg.n_keys
        keys = torch.rand(B, K, generator=g).argsort(dim=1)[:, :n]  # (B, n): distinct keys per sequence
        values = K + torch.randint(0, self.cfg.n_values, (B, n), generator=g)  # (B, n): value ids follow the keys
        # Queries drawn with replacement: were each key asked once, the last answer would follow by
        # elimination (the one value not yet given) without looking anything up.
        order = torch.randint(0, n, (B, n), generator=g)  # (B, n): which pair each query asks for
        q_keys, q_values = keys.gather(1, order), values.gather(1, order)  # (B, n) each
        context = torch.stack([keys, values], dim=2).flatten(1)  # (B, n, 2) -> (B, 2n): k1 v1 k2 v2 ...
        queries = torch.stack([q_keys, q_values], dim=2).flatten(1)  # (B, 2n)
        sep = torch.full((B, 1), self.vocab_size - 1)  # (B, 1)
        return torch.cat([context, sep, queries], dim=1)  # (B, 4n + 1)

    def batch(self, step: int, rank: int = 0, world: int = 1, split: str = "train") -> tuple[Tensor, Tensor]:
        seq = self.sequences(generator(self.cfg.seed, "recall", split, step), self.cfg.batch_size)
        x, y = seq[:, :-1], seq[:, 1:].clone()  # (B, 4n) each
        scored = torch.zeros_like(y, dtype=torch.bool)
        scored[:, 2 * self.cfg.n_pairs + 1 :: 2] = True  # x there is a query key, y its value
        y[~scored] = IGNORE
        return shard(x, y, rank, world)

    def answer_sources(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Where each answer must be read from: ``(queries (n,), values (B, n))`` positions in ``x`` ``(B, 4n)``.

        ``x[:, queries[j]]`` is the j-th query key (its next token, the answer, is scored) and
        ``x[:, values[:, j]]`` is the value that follows the same key in the context: the one
        position a correct lookup must read. (Keys are distinct within a sequence.)
        """
        n = self.cfg.n_pairs
        keys = x[:, 0 : 2 * n : 2]  # (B, n): k1 k2 ... of the context
        queries = torch.arange(2 * n + 1, 4 * n, 2)  # (n,): positions of the query keys
        pair = (x[:, queries, None] == keys[:, None, :]).int().argmax(-1)  # (B, n, 1) == (B, 1, n) -> (B, n)
        return queries, 2 * pair + 1  # the value sits right after its key


class CopyTask:
    """Copy: ``copy_len`` random symbols, ``|``, the same symbols again. The copied half is scored:
    token ``t`` is the one ``copy_len + 1`` positions back, which attention reads by position."""

    def __init__(self, cfg: DataConfig) -> None:
        if not 1 <= cfg.copy_len or not 2 <= cfg.n_symbols <= len(KEYS):
            raise UsageError(
                f"copy needs copy_len >= 1 and 2 <= n_symbols <= {len(KEYS)}, got copy_len={cfg.copy_len}, "
                f"n_symbols={cfg.n_symbols}; change --data.copy-len or --data.n-symbols."
            )
        self.cfg = cfg
        self.tokenizer = CharTokenizer(KEYS[: cfg.n_symbols] + SEP)
        self.vocab_size = self.tokenizer.vocab_size
        self.block_size = sequence_length(cfg)  # 2L
        self.chance_acc = 1.0 / cfg.n_symbols

    def batch(self, step: int, rank: int = 0, world: int = 1, split: str = "train") -> tuple[Tensor, Tensor]:
        B, L = self.cfg.batch_size, self.cfg.copy_len
        g = generator(self.cfg.seed, "copy", split, step)
        symbols = torch.randint(0, self.cfg.n_symbols, (B, L), generator=g)  # (B, L)
        seq = torch.cat([symbols, torch.full((B, 1), self.vocab_size - 1), symbols], dim=1)  # (B, 2L + 1)
        x, y = seq[:, :-1], seq[:, 1:].clone()  # (B, 2L) each
        y[:, :L] = IGNORE  # the first half is random: nothing to learn there
        return shard(x, y, rank, world)


class TextCharDataset:
    """Random windows of ``seq_len + 1`` characters of a UTF-8 file; the first 90% trains, the rest is held out."""

    def __init__(self, cfg: DataConfig) -> None:
        if cfg.text_path is None:
            raise UsageError(
                "--data.task text needs --data.text-path, got none; pass a UTF-8 text file, e.g. --data.text-path README.md."
            )
        path = Path(cfg.text_path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(
                f"--data.text-path {str(path)!r} could not be read as UTF-8 ({e}); pass a readable UTF-8 text file."
            ) from None
        n_val = len(text) // 10
        if len(text) - n_val < cfg.seq_len + 2 or n_val < cfg.seq_len + 2:
            fits = n_val - 2  # the held-out tenth must hold one window of seq_len + 1 and a start to draw
            fix = f"pass --data.seq-len {fits} or less, or a longer file" if fits >= 1 else "pass a longer file"
            raise UsageError(
                f"--data.text-path {str(path)!r} has {len(text)} characters, too few for --data.seq-len {cfg.seq_len} "
                f"(it needs {10 * (cfg.seq_len + 2)}: a tenth is held out); {fix}."
            )
        self.cfg = cfg
        self.tokenizer = CharTokenizer.from_text(text)
        ids = torch.tensor(self.tokenizer.encode(text), dtype=torch.long)  # (N,)
        self.splits = {"train": ids[: len(ids) - n_val], "eval": ids[len(ids) - n_val :]}
        self.vocab_size = self.tokenizer.vocab_size
        self.block_size = sequence_length(cfg)
        self.chance_acc = 1.0 / self.vocab_size

    def batch(self, step: int, rank: int = 0, world: int = 1, split: str = "train") -> tuple[Tensor, Tensor]:
        ids, T = self.splits[split], self.cfg.seq_len
        starts = torch.randint(
            0, len(ids) - T - 1, (self.cfg.batch_size,), generator=generator(self.cfg.seed, "text", split, step)
        )  # (B,)
        window = starts[:, None] + torch.arange(T + 1)  # (B, T + 1) indices
        seq = ids[window]  # (B, T + 1)
        return shard(seq[:, :-1], seq[:, 1:], rank, world)


def build_task(cfg: DataConfig) -> RandomTask | RecallTask | CopyTask | TextCharDataset:
    """The data source named by ``cfg.task``."""
    tasks: dict[str, type[RandomTask | RecallTask | CopyTask | TextCharDataset]] = {
        "recall": RecallTask,
        "copy": CopyTask,
        "random": RandomTask,
        "text": TextCharDataset,
    }
    if cfg.task not in tasks:
        raise UsageError(f"--data.task must be one of {sorted(tasks)}, got {cfg.task!r}; pick one of them.")
    return tasks[cfg.task](cfg)
