//! The gRPC codec of every service here: prost, with small initial buffers.
//!
//! tonic gives each stream an encode and a decode buffer of 8 KiB by
//! default. A tunneled connection is one stream on the gRPC frontend, so
//! that was 16 KiB of the server's memory per idle connection; buffers grow
//! as messages need, so starting small costs bulk transfers nothing.

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// Initial size of a stream's encode and decode buffers.
const INITIAL_BUFFER: usize = 512;
/// tonic's default: an encoder yields to the transport after this much.
const YIELD_THRESHOLD: usize = 32 * 1024;

/// A prost codec with [`INITIAL_BUFFER`]-sized buffers.
#[derive(Debug, Clone, Copy)]
pub struct LeanCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for LeanCodec<T, U> {
    fn default() -> Self {
        LeanCodec(PhantomData)
    }
}

impl<T, U> Codec for LeanCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::new(INITIAL_BUFFER, YIELD_THRESHOLD))
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(BufferSettings::new(INITIAL_BUFFER, YIELD_THRESHOLD))
    }
}
