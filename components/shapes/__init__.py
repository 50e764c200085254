"""The shapes demo's world, which the built-in shapes datasets, the shapes rewards and the demo models' pretraining
(components/models/shapes_pretrain.py, shapes_edit_pretrain.py) share: scenes (their grammar, placing and drawing),
the detector that reads a scene back from an image, and edits."""
