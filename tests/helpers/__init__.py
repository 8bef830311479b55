"""What several test files share: the references (plain PyTorch, written separately from the
package), the shared-prefix test groups and steps, tiny checkpoints and runs of the main job.
Test files import from here, never from another test file."""
