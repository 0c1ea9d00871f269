"""The runtime: applies a plan to a real model. Block groups (one block's chunks and the verbs
fetch, release, reduce gradients, update), the hooks that call them, the device cache, and the
three update modes. It decides nothing the plan does not say."""
