"""What a person sees and types: progress, quick exit, error lines, closed pipes, whole numbers."""
