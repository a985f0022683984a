"""The protected-token table: token types whose prefix rows a "+protected" fill runs exactly (docs/method.md).

The fill's damage is not spread evenly over a prompt's tokens: some classes of token carry more of it than their
share of the text. Four classes are eligible: capitalized word starts, capitalized word pieces, lower-case word
pieces, and mixed tokens (not all letters, not all punctuation, not digits with punctuation). Lower-case word
starts, numbers, punctuation, digits with punctuation, whitespace and special tokens are not.

Of the eligible tokens, the rarest 25 % run exactly. Rarity is the add-one unigram log-frequency over the
capture's calibration documents, log((count + 1) / (tokens + vocabulary)), and "25 %" is a share of the eligible
tokens of that text: eligible types are taken rarest first (ties by token id) while their calibration occurrences
stay within 25 % of all eligible occurrences. So on text like the calibration text a quarter of the eligible
positions are protected, and every eligible type the calibration text never used is (a count of zero). A table of
token ids is stored in the solve artifact and the release; a fill looks up each prefix token in it.
"""

from __future__ import annotations

import numpy as np

SHARE = 0.25
ELIGIBLE = ("cap_word_start", "cap_piece", "lower_piece", "mixed")


def token_class(piece: str, special: bool = False) -> str:
    """The class of a token from its text (`tokenizer.convert_tokens_to_string([token])`, which keeps a word
    start's leading space)."""
    if special:
        return "special"
    body = piece.lstrip()
    start = len(body) < len(piece)
    if not body or body.isspace():
        return "space"
    if body.isalpha():
        cap = body[0].isupper()
        if start:
            return "cap_word_start" if cap else "lower_word_start"
        return "cap_piece" if cap else "lower_piece"
    if body.isdigit():
        return "number"
    if not any(c.isalnum() for c in body):
        return "punct"
    if all(c.isdigit() or not c.isalnum() for c in body):
        return "digits_punct"
    return "mixed"


def special_ids(tokenizer) -> set[int]:
    """The tokenizer's special tokens: its named ones (bos, eos, ...) and every added token flagged special
    (SmolLM2's `<file_sep>`, `<jupyter_code>`, ...; Gemma 3's `<unusedN>`), which calibration text never holds."""
    flagged = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return set(tokenizer.all_special_ids) | {int(i) for i, t in flagged.items() if getattr(t, "special", False)}


def token_classes(tokenizer, vocab: int) -> list[str]:
    """The class of every token id below `vocab` (ids the tokenizer does not know are "special")."""
    special = special_ids(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(vocab)))
    out = []
    for i, t in enumerate(pieces):
        if t is None or i in special:
            out.append("special")
        else:
            out.append(token_class(tokenizer.convert_tokens_to_string([t]), False))
    return out


def protected_table(counts: np.ndarray, classes: list[str], share: float = SHARE) -> tuple[np.ndarray, dict]:
    """(token ids int32 ascending, facts) from calibration counts [vocab] and each id's class (the rule above)."""
    counts = np.asarray(counts, dtype=np.int64)
    eligible = np.array([c in ELIGIBLE for c in classes[: len(counts)]] + [False] * (len(counts) - len(classes)))
    logf = np.log((counts + 1) / (counts.sum() + len(counts)))
    ids = np.nonzero(eligible)[0]
    order = ids[np.lexsort((ids, logf[ids]))]  # rarest first, ties by id
    cum = np.cumsum(counts[order])
    budget = share * counts[ids].sum()
    take = order[cum <= budget]
    table = np.sort(take).astype(np.int32)
    per_class = {c: int(sum(1 for i in table if classes[i] == c)) for c in ELIGIBLE}
    facts = {"share": share, "eligible_types": int(len(ids)), "types": int(len(table)),
             "unseen_types": int((counts[table] == 0).sum()), "by_class": per_class,
             "max_count": int(counts[table].max()) if len(table) else 0}
    return table, facts
