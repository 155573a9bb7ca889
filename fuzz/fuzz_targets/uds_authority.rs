#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| konnectivity_fuzzing::uds_authority(data));
