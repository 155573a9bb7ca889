#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| konnectivity_fuzzing::resume_handshake(data));
