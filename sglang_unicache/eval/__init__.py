"""Quality evaluation: the synthetic visual-QA task the trained tiny VLM is scored on."""
