//! The `#[repr(C)]` mirrors of 3FS's `hf3fs_iov`, `hf3fs_ior` and `hf3fs_cqe` against
//! the layout a C compiler gives the declarations of `hf3fs_usrbio.h`
//! (tests/fixtures/hf3fs_usrbio_structs.h).

mod cfixture;

use hf3fs_gdr::hf3fs::ffi;
use std::collections::HashMap;

#[test]
fn rust_mirrors_match_the_c_layout() {
    let Some(cc) = cfixture::compiler() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("hf3fs_abi");
    cfixture::compile(&cc, &["hf3fs_abi.c"], &[], &exe);
    let out = std::process::Command::new(&exe).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    // "<struct> size <n> align <n>" and "<struct>.<field> <offset>".
    let mut c: HashMap<String, usize> = HashMap::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words[..] {
            [name, "size", size, "align", align] => {
                c.insert(format!("{name} size"), size.parse().unwrap());
                c.insert(format!("{name} align"), align.parse().unwrap());
            }
            [field, offset] => {
                c.insert(field.to_string(), offset.parse().unwrap());
            }
            _ => panic!("unexpected line {line:?}"),
        }
    }
    let mut checked = 0;
    for (name, size, align, fields) in ffi::layouts() {
        assert_eq!(c[&format!("{name} size")], size, "sizeof(struct {name})");
        assert_eq!(c[&format!("{name} align")], align, "alignof(struct {name})");
        for (field, offset) in fields {
            assert_eq!(
                c[&format!("{name}.{field}")],
                offset,
                "offsetof({name}, {field})"
            );
            checked += 1;
        }
    }
    assert_eq!(checked + 6, c.len(), "every C line compared");
    // The crate's public completion type is 3FS's too.
    assert_eq!(std::mem::size_of::<hf3fs_gdr::Cqe>(), c["hf3fs_cqe size"]);
    assert_eq!(
        std::mem::offset_of!(hf3fs_gdr::Cqe, result),
        c["hf3fs_cqe.result"]
    );
    assert_eq!(
        std::mem::offset_of!(hf3fs_gdr::Cqe, userdata),
        c["hf3fs_cqe.userdata"]
    );
    println!("{checked} field offsets and 3 struct sizes match the C compiler");
}
