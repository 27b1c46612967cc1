"""The off-policy correction and what it must rebuild exactly.

- ``importance.py``: the importance weights of stale samples, as pure tensor functions.
- ``sampling.py``: the distribution an engine samples each token from, applied on both sides of the ratio.
- ``generation_modes.py``: which decoding modes draw each token from those scores (where mu is recorded).
- ``seam.py``: where the trainer computes pi_prox and hands the weight to GRPOTrainer's loss;
  ``attributes.py``: settings swapped for the length of one call.
"""
