"""Starting a run from existing weights (``checkpoint.init_from``).

- :mod:`~moetrain.init_from.source`: open and check a source (a Hugging Face model directory of
  a registered family, a moetrain checkpoint or run directory) and the config it implies.
- :mod:`~moetrain.init_from.weights`: its weights streamed (an expert-parallel rank reads only
  its experts) and a model built from them.
- :mod:`~moetrain.init_from.upcycle`: an MoE layer's weights made from a dense FFN.
"""
