#!/usr/bin/env python3
"""Build the training corpus and the tokenizer for the tiny embedded model (models/tiny).

Corpus: Jane Austen's six completed novels (public domain; 1811-1817) as shipped in Debian's
package r-cran-janeaustenr (1.0.0-1; upstream CRAN janeaustenr 1.0.0 by Julia Silge, MIT; the
texts come from Project Gutenberg). The package stores each novel as an R character vector (one
element per printed line) in R's lazy-load database data/Rdata.rdb/.rdx; this script reads that
format directly (a small reader for R's XDR serialization, below), so R is not needed.

Steps (deterministic, CPU, a few seconds):
  1. fetch the .deb with `apt-get download` (or take --deb PATH) and unpack it with `dpkg-deb -x`;
  2. read the six novels, re-flow the hard-wrapped lines into paragraphs (one paragraph per line,
     paragraphs separated by a blank line), drop the `_italic_` underscores;
  3. hold out the last 5% (at most, by characters, cut at a paragraph boundary) of every novel: the
     held-out text is models/tiny/heldout.txt (the six spans joined by a blank line);
  4. train a byte-level BPE tokenizer (vocab 4096 incl. 3 special tokens) on the training text;
  5. write token ids: train.bin / heldout.bin (uint16), novels joined by <|endoftext|>.

Usage:  python3 scripts/train_tiny/prepare.py [--out .train] [--deb r-cran-janeaustenr_1.0.0-1_all.deb]
"""
import argparse
import gzip
import hashlib
import json
import lzma
import bz2
import re
import struct
import subprocess
import sys
import tempfile
import unicodedata
import zlib
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parents[2]
DEB_NAME = "r-cran-janeaustenr"
DEB_VERSION = "1.0.0-1"
DATA_DIR = "usr/lib/R/site-library/janeaustenr/data"
# Order of the novels in the corpus (publication order).
NOVELS = [("sensesensibility", "Sense and Sensibility"), ("prideprejudice", "Pride and Prejudice"),
          ("mansfieldpark", "Mansfield Park"), ("emma", "Emma"),
          ("northangerabbey", "Northanger Abbey"), ("persuasion", "Persuasion")]
HELDOUT_FRACTION = 0.05
VOCAB_SIZE = 4096
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen-style pre-tokenizer split (same pipeline as the qwen3_5_moe fixture tokenizer).
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
                     r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


# ---------------------------------------------------------------------------------------------
# A minimal reader for R's serialization format (XDR, versions 2 and 3), enough for the
# character vectors, lists and pairlists in janeaustenr's lazy-load database.
# ---------------------------------------------------------------------------------------------
class RReader:
    NILVALUE, GLOBALENV, UNBOUND, MISSING, BASENS, EMPTYENV, BASEENV = 254, 253, 252, 251, 250, 242, 241
    REFSXP, NAMESPACESXP, PACKAGESXP, PERSISTSXP = 255, 249, 248, 247

    def __init__(self, buf):
        self.b, self.p, self.refs = buf, 0, []
        if self.b[:2] != b"X\n":
            raise ValueError("not an XDR R serialization stream")
        self.p = 2
        version = self.int()
        self.int(), self.int()  # writer version, minimal reader version
        if version == 3:
            nlen = self.int()  # native encoding name
            self.p += nlen
        elif version != 2:
            raise ValueError(f"R serialization version {version}")

    def int(self):
        v = struct.unpack_from(">i", self.b, self.p)[0]
        self.p += 4
        return v

    def length(self):
        n = self.int()
        if n == -1:  # long vector: two 32-bit halves
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def item(self):
        flags = self.int()
        t, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if t == self.NILVALUE or t in (self.GLOBALENV, self.UNBOUND, self.MISSING, self.BASENS,
                                      self.EMPTYENV, self.BASEENV):
            return None
        if t == self.REFSXP:
            idx = flags >> 8
            return self.refs[(idx if idx else self.int()) - 1]
        if t in (self.NAMESPACESXP, self.PACKAGESXP, self.PERSISTSXP):
            self.int()  # 0
            strs = [self.item() for _ in range(self.length())]
            self.refs.append(strs)
            return strs
        if t == 1:  # SYMSXP
            s = self.item()
            self.refs.append(s)
            return s
        if t in (2, 3, 5, 6, 17):  # pairlist-like: [attr] [tag] car cdr
            attr = self.item() if has_attr else None
            tag = self.item() if has_tag else None
            car = self.item()
            cdr = self.item()
            out = [(tag, car)] + (cdr if isinstance(cdr, list) else [])
            return out
        if t == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None
            latin1 = (flags >> 12) & 4  # LATIN1_MASK in the CHARSXP's levels; otherwise UTF-8/ASCII
            s = self.b[self.p:self.p + n].decode("latin-1" if latin1 else "utf-8")
            self.p += n
            return s
        if t in (10, 13):  # LGLSXP, INTSXP
            n = self.length()
            v = list(struct.unpack_from(f">{n}i", self.b, self.p))
            self.p += 4 * n
        elif t == 14:  # REALSXP
            n = self.length()
            v = list(struct.unpack_from(f">{n}d", self.b, self.p))
            self.p += 8 * n
        elif t == 16:  # STRSXP
            v = [self.item() for _ in range(self.length())]
        elif t in (19, 20):  # VECSXP, EXPRSXP
            v = [self.item() for _ in range(self.length())]
        else:
            raise ValueError(f"unsupported R SEXP type {t} at byte {self.p}")
        if has_attr:
            attrs = dict(self.item())
            names = attrs.get("names")
            if names is not None and t in (19, 20):
                return dict(zip(names, v))
        return v


def r_unserialize(buf):
    return RReader(buf).item()


def lazyload_blob(rdb, offset, length):
    """One object of an R lazy-load database: 4-byte big-endian size, then the compressed stream."""
    blob = rdb[offset:offset + length]
    size = struct.unpack(">I", blob[:4])[0]
    body = blob[4:]
    kind = body[:1]
    if kind == b"Z":
        data = lzma.decompress(body[1:])
    elif kind == b"2":
        data = bz2.decompress(body[1:])
    elif kind == b"0":
        data = body[1:]
    else:
        data = zlib.decompress(body)
    assert len(data) == size, (len(data), size)
    return data


def read_novels(pkg_root):
    d = Path(pkg_root) / DATA_DIR
    index = r_unserialize(gzip.decompress((d / "Rdata.rdx").read_bytes()))
    rdb = (d / "Rdata.rdb").read_bytes()
    out = {}
    for name, (off, ln) in index["variables"].items():
        out[name] = r_unserialize(lazyload_blob(rdb, off, ln))
    return out


# ---------------------------------------------------------------------------------------------
# Text clean-up
# ---------------------------------------------------------------------------------------------
def paragraphs(lines):
    """Re-flow hard-wrapped lines: blank lines separate paragraphs; lines inside one are joined."""
    paras, cur = [], []
    for line in lines:
        line = (line or "").strip()
        if line:
            cur.append(line)
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    out = []
    for p in paras:
        p = unicodedata.normalize("NFC", p).replace("_", "")
        p = re.sub(r"\s+", " ", p).strip()
        if p:
            out.append(p)
    return out


def split_heldout(paras, frac):
    """Hold out the last `frac` of a novel (by characters), cut at a paragraph boundary."""
    total = sum(len(p) + 2 for p in paras)
    acc, cut = 0, len(paras)
    while cut > 0 and acc + len(paras[cut - 1]) + 2 <= frac * total:  # at most `frac` held out
        cut -= 1
        acc += len(paras[cut]) + 2
    return paras[:cut], paras[cut:]


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
def build_tokenizer(texts, vocab_size):
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def fetch_deb(workdir):
    subprocess.run(["apt-get", "download", f"{DEB_NAME}={DEB_VERSION}"], cwd=workdir, check=True)
    debs = sorted(Path(workdir).glob(f"{DEB_NAME}_*.deb"))
    if not debs:
        sys.exit("apt-get download produced no .deb")
    return debs[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / ".train"), help="scratch folder (git-ignored)")
    ap.add_argument("--deb", help="use this r-cran-janeaustenr .deb instead of apt-get download")
    ap.add_argument("--heldout-out", default=str(ROOT / "models/tiny/heldout.txt"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory() as tmp:
        deb = Path(args.deb).resolve() if args.deb else fetch_deb(tmp)
        print(f"corpus package: {deb.name} sha256 {hashlib.sha256(deb.read_bytes()).hexdigest()}")
        subprocess.run(["dpkg-deb", "-x", str(deb), tmp + "/pkg"], check=True)
        novels = read_novels(tmp + "/pkg")

    train_docs, held_docs, stats = [], [], []
    for key, title in NOVELS:
        paras = paragraphs(novels[key])
        tr, ho = split_heldout(paras, HELDOUT_FRACTION)
        train_docs.append("\n\n".join(tr))
        held_docs.append("\n\n".join(ho))
        stats.append((title, len(paras), len(train_docs[-1]), len(held_docs[-1])))
    for s in stats:
        print("%-24s paragraphs %5d  train chars %8d  held-out chars %7d" % s)

    heldout_text = "\n\n".join(held_docs) + "\n"
    Path(args.heldout_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.heldout_out).write_text(heldout_text, encoding="utf-8")
    (out / "train.txt").write_text("\n\n<|endoftext|>\n\n".join(train_docs), encoding="utf-8")
    n_train_chars = sum(len(t) for t in train_docs)
    print(f"train chars {n_train_chars}, held-out chars {len(heldout_text)} "
          f"({len(heldout_text.encode('utf-8'))} bytes) -> {args.heldout_out}")
    non_ascii = sorted({c for t in train_docs for c in t if ord(c) > 127})
    print("non-ASCII characters in the training text:", "".join(non_ascii))

    # Tokenizer: trained on the training paragraphs only.
    tok = build_tokenizer((p for t in train_docs for p in t.split("\n\n")), VOCAB_SIZE)
    tok.save(str(out / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")

    ids = []
    for i, t in enumerate(train_docs):
        if i:
            ids.append(eot)
        ids.extend(tok.encode(t).ids)
    train_ids = np.array(ids, dtype=np.uint16)
    held_ids = np.array(tok.encode(heldout_text).ids, dtype=np.uint16)
    train_ids.tofile(out / "train.bin")
    held_ids.tofile(out / "heldout.bin")
    for t in train_docs[:1]:
        assert tok.decode(tok.encode(t[:2000]).ids) == t[:2000]
    meta = dict(vocab_size=VOCAB_SIZE, specials={s: tok.token_to_id(s) for s in SPECIALS},
                train_tokens=int(train_ids.size), heldout_tokens=int(held_ids.size),
                train_chars=n_train_chars, heldout_chars=len(heldout_text), deb=deb.name)
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta))
    print(f"chars/token (train): {n_train_chars / train_ids.size:.3f}")


if __name__ == "__main__":
    main()
