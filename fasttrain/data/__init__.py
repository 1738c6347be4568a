"""The input pipelines: the loader contract (``loader.py``), every backend (DALI, torchvision,
synthetic), the folder scan they share, the check for undecodable images and the built-in sample
set; ``build.py`` makes a run's loaders from the config."""
