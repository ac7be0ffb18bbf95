#!/usr/bin/env python3
# tests/fuzz/make_seeds.py: writes the seed corpus tests/fuzz/corpus/<target>/: small valid files of
# every reader's format and a few edge cases, from which libFuzzer mutates. Python stdlib only; rerun
# after changing a format and commit the result (the 'fuzz' test suite replays every file).
import gzip
import json
import pathlib
import struct
import zlib

HERE = pathlib.Path(__file__).resolve().parent


def write(target, name, data):
    path = HERE / "corpus" / target / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


def idx(code, shape, payload):
    return bytes([0, 0, code, len(shape)]) + b"".join(struct.pack(">I", s) for s in shape) + payload


def idx_seeds():
    write("idx", "u8_1d.idx", idx(0x08, [3], bytes([1, 2, 3])))
    images = idx(0x08, [2, 2, 3], bytes(range(12)))
    write("idx", "u8_3d.idx", images)
    write("idx", "i8.idx", idx(0x09, [4], bytes([0, 1, 0x7F, 0x80])))
    write("idx", "i16.idx", idx(0x0B, [2, 2], struct.pack(">4h", 1, -1, 32767, -32768)))
    write("idx", "i32.idx", idx(0x0C, [3], struct.pack(">3i", 7, -7, 2**31 - 1)))
    write("idx", "f32.idx", idx(0x0D, [2], struct.pack(">2f", 1.5, -0.25)))
    write("idx", "f64.idx", idx(0x0E, [1, 2], struct.pack(">2d", 3.0, float("inf"))))
    write("idx", "empty.idx", idx(0x08, [2, 0], b""))
    # mtime 0: the same bytes on every run.
    write("idx", "u8_3d.idx.gz", gzip.compress(images, mtime=0))


def safetensors(tensors, metadata=None):
    """tensors: [(name, dtype, shape, bytes)], laid end to end as the writers do."""
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, payload in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    text = json.dumps(header, separators=(",", ":"))
    text += " " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text.encode() + data


def safetensors_seeds():
    write("safetensors", "f32_i64.safetensors", safetensors(
        [("w", "F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4)), ("b", "I64", [2], struct.pack("<2q", -1, 5))],
        {"format": "pt"}))
    write("safetensors", "all_dtypes.safetensors", safetensors([
        ("f64", "F64", [1], struct.pack("<d", 0.5)),
        ("bf16", "BF16", [2], bytes([0x80, 0x3F, 0, 0xC0])),
        ("f16", "F16", [2], bytes([0, 0x3C, 0, 0xBC])),
        ("i32", "I32", [1], struct.pack("<i", -3)),
        ("u8", "U8", [3], bytes([0, 128, 255])),
        ("mask", "BOOL", [2], bytes([0, 1])),
    ]))
    write("safetensors", "empty_tensor.safetensors",
          safetensors([("none", "F32", [0, 3], b""), ("one", "U8", [], bytes([9]))]))
    write("safetensors", "no_tensors.safetensors", safetensors([], {"note": "nothing"}))


# GPT-2's byte -> symbol table, which the ByteLevel pre-tokenizer uses (data/byte_level.h).
def byte_symbols():
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def added(token_id, content):
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def tokenizer(vocab_tokens, merges, added_tokens, merges_as_strings=False):
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added_tokens,
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
        "decoder": dict(byte_level, add_prefix_space=True),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {token: i for i, token in enumerate(vocab_tokens)},
                  "merges": [f"{a} {b}" if merges_as_strings else [a, b] for a, b in merges]},
    }, ensure_ascii=False, separators=(",", ":"))


def tokenizer_seeds():
    symbols = sorted(byte_symbols())  # in code point order, as a trained tokenizer lists them
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
    learned = [a + b for a, b in merges]
    specials = ["[BOT]", "[EOT]", "[PAD]"]
    write("tokenizer", "ours.json", tokenizer(
        specials + symbols + learned, merges, [added(i, t) for i, t in enumerate(specials)]))
    # Hugging Face's shape: merges as "left right", the end-of-text token after the vocabulary.
    write("tokenizer", "hf_after_vocab.json", tokenizer(
        symbols + learned, merges, [added(len(symbols) + len(learned), "<|endoftext|>")], merges_as_strings=True))
    # No added token at all: every role gets ours appended.
    write("tokenizer", "bytes_only.json", tokenizer(symbols, [], []))


# The checkpoint target's rank files (tests/fuzz/targets.h): 48 bytes, byte k of file r = (r * 64 + k) & 0xff.
CHECKPOINT_FILE_BYTES = 48


def rank_file(rank):
    return f"rank-{rank:05}-of-00002.bin"


def rank_crc(rank):
    return zlib.crc32(bytes((rank * 64 + k) & 0xFF for k in range(CHECKPOINT_FILE_BYTES)))


def chunk(rank, offset, first, count):
    return {"file": rank_file(rank), "offset": offset, "bytes": 4 * count, "first": first, "count": count}


def metadata(tensors, files=None, step=3):
    files = files or {rank_file(r): {"bytes": CHECKPOINT_FILE_BYTES, "crc32": rank_crc(r)} for r in range(2)}
    return json.dumps({
        "format": "shardlab-sharded-checkpoint", "version": 1, "world_size": 2, "sharding": "full",
        "files": files, "tensors": tensors,
        "optimizer": {"step": step, "hyper_parameters": {"param_groups.0.lr": 0.001, "param_groups.0.beta1": 0.9},
                      "parameter_steps": {"w": step} if "optim.w.exp_avg" in tensors else {}},
        "extra": {"epoch": 1, "note": "seed"},
    }, indent=1) + "\n"


def checkpoint_seeds():
    # As save_checkpoint lays out a 2-rank FULL_SHARD: each rank holds half of every tensor.
    write("checkpoint", "full.json", metadata({
        "w": {"shape": [2, 3], "dtype": "F32", "chunks": [chunk(0, 0, 0, 3), chunk(1, 0, 3, 3)]},
        "b": {"shape": [3], "dtype": "F32", "chunks": [chunk(0, 12, 0, 2), chunk(1, 12, 2, 1)]},
        "optim.w.exp_avg": {"shape": [2, 3], "dtype": "F32", "chunks": [chunk(0, 20, 0, 3), chunk(1, 16, 3, 3)]},
    }))
    write("checkpoint", "scalar_and_empty.json", metadata({
        "scale": {"shape": [], "dtype": "F32", "chunks": [chunk(1, 44, 0, 1)]},
        "none": {"shape": [0, 4], "dtype": "F32", "chunks": []},
    }))
    write("checkpoint", "no_tensors.json", metadata({}, step=0))
    # Valid metadata whose CRC32s do not match the files: checkpoint_info reads it, consolidation refuses.
    write("checkpoint", "bad_crc.json", metadata(
        {"v": {"shape": [12], "dtype": "F32", "chunks": [chunk(0, 0, 0, 12)]}},
        files={rank_file(r): {"bytes": CHECKPOINT_FILE_BYTES, "crc32": 1} for r in range(2)}))


def text_corpus_seeds():
    write("text_corpus", "fortunes.txt", "A fortune\nof two lines.\n%\nAnother one.\n%\n")
    write("text_corpus", "blank_documents.txt", "%\n   \n%\n\t\n%\nlast, with no newline")
    write("text_corpus", "crlf.txt", "windows line\r\n%\r\nnot a separator\r\n%\n")
    write("text_corpus", "only_separators.txt", "%\n%\n%\n")
    write("text_corpus", "bytes.txt", b"\x00\xff\xfe binary\n%\n\xc3\xa9t\xc3\xa9\n")


if __name__ == "__main__":
    idx_seeds()
    safetensors_seeds()
    tokenizer_seeds()
    checkpoint_seeds()
    text_corpus_seeds()
