"""The Hugging Face Hub: model downloads (snapshot.py), release push and pull (releases.py), and what they share,
among it the one mapping of Hub failures to one-line errors (client.py). huggingface_hub is imported inside the
functions."""
