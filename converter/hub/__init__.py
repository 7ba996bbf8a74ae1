"""The Hugging Face Hub: converting straight from it, and publishing a checked DST to it."""
