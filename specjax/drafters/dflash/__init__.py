"""DFlash block drafters: `network` (the published architecture), `drafter` (`DFlashDrafter`:
argmax and sampled chains), `tree` (DDTree, static and sampled trees from one block),
`checkpoint` (`load_dflash` / `save_dflash` in z-lab's layout)."""
