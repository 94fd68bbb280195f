#!/usr/bin/env python3
"""Writes a tiny, deterministic, synthetic stand-in for SpeechBrain's
``tests/samples`` data, in exactly the layout and annotation format that the
vendored recipes (``asr_ctc/`` and ``speaker_id/``) read:

    OUT_DIR/ASR/spk{1,2}_snt{1..8}.wav       16 kHz mono PCM-16, 0.35-0.5 s
    OUT_DIR/annotation/ASR_train.json        12 utterances (snt1..6 of each speaker)
    OUT_DIR/annotation/ASR_dev.json           4 utterances (snt7..8 of each speaker)

Each JSON entry has the keys the recipes use (``wav`` with the ``{data_root}``
placeholder, ``spk_id``, ``phn``) plus ``duration``, like SpeechBrain's
``tests/samples/annotation/ASR_*.json``.  The phone strings use the same 43
phones as SpeechBrain's samples, so ``num_labels: 44`` (43 + blank) holds for
both this data and the real samples.  The audio is a sequence of tones, one
per phone (frequency from the phone, pitch/timbre from the speaker), so the
models have something learnable; the run is a smoke test, not a benchmark.

Usage: python tests/sb_recipes/make_data.py OUT_DIR
Same output bytes on every run (fixed seed, no clock).
"""

import json
import os
import sys

import numpy as np
import soundfile as sf

SAMPLE_RATE = 16000
SEED = 1234

# The 43 phones of SpeechBrain's tests/samples/annotation/ASR_{train,dev}.json
PHONES = (
    "aa ae ah ao aw ax ay b ch cl d dh dx eh er ey f g hh ih iy jh k l m n "
    "ng ow oy p r s sh sil t th uh uw v vcl w y z"
).split()
assert len(PHONES) == 43

SPEAKERS = {
    # spk_id: (pitch factor, harmonic weight, noise level)
    "spk1": (1.0, 0.5, 0.005),
    "spk2": (1.35, 0.1, 0.02),
}
N_TRAIN_PER_SPK = 6
N_DEV_PER_SPK = 2


def phone_sequences(rng, n_utts):
    """n_utts phone sequences of 6-8 phones, no phone twice in a row, all 43
    phones used at least once overall (needed by label_encoder.expect_len)."""
    pool = []
    seqs = []
    for _ in range(n_utts):
        n = int(rng.integers(6, 9))
        seq = []
        while len(seq) < n:
            if not pool:
                pool = list(rng.permutation(len(PHONES)))
            p = int(pool.pop())
            if seq and seq[-1] == p:
                pool.insert(0, p)
                continue
            seq.append(p)
        seqs.append(seq)
    used = {p for s in seqs for p in s}
    assert used == set(range(len(PHONES))), "not every phone used"
    return seqs


def synth(rng, seq, spk, n_samples):
    """Concatenated tones, one equal-length segment per phone."""
    pitch, harm, noise = SPEAKERS[spk]
    bounds = np.linspace(0, n_samples, len(seq) + 1).astype(int)
    out = np.zeros(n_samples, dtype=np.float64)
    for p, a, b in zip(seq, bounds[:-1], bounds[1:]):
        t = np.arange(b - a) / SAMPLE_RATE
        f = (150.0 + 45.0 * p) * pitch
        seg = np.sin(2 * np.pi * f * t) + harm * np.sin(4 * np.pi * f * t)
        seg *= np.hanning(b - a) * 0.3
        out[a:b] = seg
    out += noise * rng.standard_normal(n_samples)
    return np.clip(out, -1.0, 1.0)


def main(out_dir):
    rng = np.random.default_rng(SEED)
    wav_dir = os.path.join(out_dir, "ASR")
    ann_dir = os.path.join(out_dir, "annotation")
    os.makedirs(wav_dir, exist_ok=True)
    os.makedirs(ann_dir, exist_ok=True)

    n_per_spk = N_TRAIN_PER_SPK + N_DEV_PER_SPK
    utts = [(spk, i) for i in range(1, n_per_spk + 1) for spk in SPEAKERS]
    seqs = phone_sequences(rng, len(utts))

    train, dev = {}, {}
    for (spk, i), seq in zip(utts, seqs):
        uid = f"{spk}_snt{i}"
        n_samples = int(rng.integers(int(0.35 * SAMPLE_RATE), SAMPLE_RATE // 2 + 1))
        wav = synth(rng, seq, spk, n_samples)
        sf.write(os.path.join(wav_dir, uid + ".wav"), wav, SAMPLE_RATE, subtype="PCM_16")
        entry = {
            "wav": "{data_root}/" + uid + ".wav",
            "duration": "%.3f" % (n_samples / SAMPLE_RATE),
            "spk_id": spk,
            "phn": " ".join(PHONES[p] for p in seq),
        }
        (train if i <= N_TRAIN_PER_SPK else dev)[uid] = entry

    for name, data in (("ASR_train.json", train), ("ASR_dev.json", dev)):
        with open(os.path.join(ann_dir, name), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=4, sort_keys=False)
            f.write("\n")
    print(f"wrote {len(train)} train + {len(dev)} dev utterances under {out_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_data.py OUT_DIR")
    main(sys.argv[1])
