"""`smcspec bench gpu` and the H200 estimate: the native engine with random weights of real
shapes on one accelerator (`runner` over `pairs`, `checks`, `probes`, `stages`, `report`,
`targets`), and the estimate that never ran on a GPU (`estimate` over `costs` and
`assumptions`)."""
