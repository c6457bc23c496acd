//! The macro behind every C enum value type of the crate (`c_newtype!`): a leaf module
//! with no imports, so that every module can define such types without importing the
//! module of another.

/// A newtype over a C enum's integer with a constant per known value: a value the
/// library returns that this crate does not know is kept as it is, never undefined
/// behaviour (a Rust `enum` would be). `Debug` prints the constant's name (or
/// `Name(value)` for an unknown value); `name()` gives it.
macro_rules! c_newtype {
    ($(#[$m:meta])* $name:ident($ty:ty) { $($(#[$cm:meta])* $c:ident = $v:path),* $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, ::serde::Serialize, ::serde::Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub $ty);
        impl $name {
            $($(#[$cm])* pub const $c: $name = $name($v as $ty);)*
            /// The name of the C constant, if known.
            pub fn name(self) -> Option<&'static str> {
                match self {
                    $(Self::$c => Some(stringify!($c)),)*
                    _ => None,
                }
            }
        }
        impl ::std::fmt::Debug for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                match self.name() {
                    Some(n) => f.write_str(n),
                    None => write!(f, "{}({})", stringify!($name), self.0),
                }
            }
        }
    };
}
pub(crate) use c_newtype;
