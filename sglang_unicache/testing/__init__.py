"""Test and demo assets made on the spot: no download needed."""
