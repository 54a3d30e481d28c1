"""Engine integration: the only layer that imports SGLang."""
