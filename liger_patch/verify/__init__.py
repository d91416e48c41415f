"""The verification sweep and its tiny-model factory: ``python -m liger_patch verify``.

For each model type of the installed transformers with a vocabulary head (causal LM,
image-text-to-text, seq2seq LM, speech seq2seq, masked LM; or a user's own architecture), a tiny
random model is built, and one training step runs unpatched and patched from the same weights on
the same batch; the loss and every gradient are compared and the type gets a status
(``verdicts``). This is the command-line layer: it uses ``patching`` and nothing below it imports
this package. Importing it imports nothing; its modules import transformers where they build
models.

The sweep:

- ``verdicts``: the statuses, what each means, a type's :class:`Verdict`, the tolerances.
- ``compare``: one model patched against unpatched (:func:`verify_model`).
- ``sweep``: a type refused by derivation, else a tiny model of it built and compared
  (:func:`verify_type`); every type (:func:`sweep`).
- ``cli``: the ``verify`` subcommand.

The tiny-model factory, in the order a model and its batch are made (seconds per type on CPU,
nothing downloaded):

- ``sizes``: the one set of tiny sizes, and which config attribute names hold which size.
- ``config_rules``: the generic rules on one (sub)config dict (its tiny values by attribute
  name, then the relations between sizes the modeling code relies on).
- ``overrides``: what the rules cannot guess, per type (values and fixes), and the types no tiny
  model can be built of here.
- ``configs``: a config shrunk (nested sub-configs included): one layer of each kind kept, the
  rules, special token ids moved into the tiny vocabulary, the overrides; the config class then
  recomputes what it derives.
- ``models``: the types and classes of each task, the model built from the shrunk config
  (float32, eager attention, train mode), and what its inputs must respect.
- ``image_layouts`` / ``images``: image inputs in each model's layout, and the number of
  placeholder tokens, counted by running the model's own ``get_image_features`` on them.
- ``batches``: the batch (ids, mask, labels with ignored positions, images), per-type batches
  and fixups.

A type whose class the patch refuses (``patching/derive.py``'s rule, e.g. a forward that takes no
labels) is reported refused before anything is built. A type no tiny model can be built of here
(a package or hub download the machine lacks) raises
:class:`~liger_patch.verify.config_rules.TinyModelError` with the reason.
"""
