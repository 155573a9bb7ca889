#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| konnectivity_fuzzing::agent_stream(data));
