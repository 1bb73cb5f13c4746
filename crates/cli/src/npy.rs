//! Writing `.npy` files (format version 1.0): little-endian f32, C order.

use std::io::Write;
use std::path::Path;

use anyhow::Context;

/// Write `data` with `shape` as a `<f4` array.
pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> anyhow::Result<()> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_str = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_str}, }}");
    // Magic (6) + version (2) + header length (2) + header, padded with spaces and a newline
    // to a multiple of 64 bytes.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + data.len() * 4);
    bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for v in data {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    let mut f =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(&bytes)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn header_is_aligned_and_data_follows() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.npy");
        super::write_f32(&p, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let b = std::fs::read(&p).unwrap();
        let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
        assert_eq!((10 + hl) % 64, 0);
        let h = std::str::from_utf8(&b[10..10 + hl]).unwrap();
        assert!(h.contains("'shape': (2, 3)") && h.ends_with('\n'));
        assert_eq!(b.len(), 10 + hl + 24);
        assert_eq!(
            f32::from_le_bytes(b[10 + hl..14 + hl].try_into().unwrap()),
            1.0
        );
    }
}
