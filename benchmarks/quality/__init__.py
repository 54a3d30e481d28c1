"""Quality evaluation: the synthetic visual-QA task the trained tiny VLM is scored on, its
transformers reference, the training script and the serving eval."""
