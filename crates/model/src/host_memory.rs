//! The host's memory as the kernel reports it, for checks made before large allocations.

/// Bytes of host memory available to new allocations without swapping (Linux
/// `MemAvailable` of `/proc/meminfo`); `None` where that is not known.
pub fn available() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .map(|kb| kb << 10)
}
