"""Media: where it may come from (policy), fetching (connector), and decoding per modality."""
